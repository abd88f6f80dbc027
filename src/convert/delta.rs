//! Source model → delta archive. Per weight type: load every layer's matrix, cluster
//! the layers (k-means, K = `bases`), store each cluster's mean as a base, then per
//! layer the truncated SVD of W − B̂. Matrices are decomposed in parallel and written
//! in model order, so the bytes do not depend on the thread count.

use std::collections::BTreeMap;
use std::path::Path;

use rayon::prelude::*;
use serde::Serialize;

use crate::archive::delta::format::{type_label, weight_type_of, WEIGHT_TYPES};
use crate::archive::delta::DeltaWriter;
use crate::archive::Compression;
use crate::codec::delta::{
    self as decompose, BaseDtype, EncodedDelta, RankChoice, TAIL_THRESHOLDS,
};
use crate::codec::{self, CodecError};
use crate::convert::{rows_per_block, ConvertError};
use crate::import::SourceModel;
use crate::model::ModelDesc;

#[derive(Clone, Debug)]
pub struct DeltaOptions {
    pub rank: RankChoice,
    /// Bases per weight type (k-means clusters of layers); 1 = the mean of all layers.
    pub bases: usize,
    pub base_dtype: BaseDtype,
    pub kmeans_iters: u32,
    pub compression: Compression,
    /// A block keeps its compressed form only where that saves this fraction.
    pub min_saving: f64,
}

impl Default for DeltaOptions {
    fn default() -> Self {
        DeltaOptions {
            rank: RankChoice::Fixed(64),
            bases: 1,
            base_dtype: BaseDtype::F16,
            kmeans_iters: 10,
            compression: Compression::Zstd(3),
            min_saving: 0.0,
        }
    }
}

impl DeltaOptions {
    pub fn validate(&self) -> Result<(), ConvertError> {
        if self.bases == 0 {
            return Err(ConvertError::Options("--bases must be at least 1".into()));
        }
        if !(0.0..=1.0).contains(&self.min_saving) {
            return Err(ConvertError::Options(format!(
                "--min-saving {} is not in [0, 1]",
                self.min_saving
            )));
        }
        if let RankChoice::MaxRelErr(e) = self.rank {
            if !(e.is_finite() && e >= 0.0) {
                return Err(ConvertError::Options(format!(
                    "--max-rel-err {e} is not a finite number ≥ 0"
                )));
            }
        }
        Ok(())
    }
    fn to_json(&self) -> serde_json::Value {
        let (rank, max_rel_err) = match self.rank {
            RankChoice::Fixed(r) => (Some(r), None),
            RankChoice::MaxRelErr(e) => (None, Some(e)),
        };
        serde_json::json!({
            "rank": rank, "max_rel_err": max_rel_err, "bases": self.bases,
            "base_dtype": self.base_dtype, "kmeans_iters": self.kmeans_iters,
        })
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct MatrixReport {
    pub name: String,
    pub layer: u32,
    #[serde(rename = "type")]
    pub ty: String,
    /// Index of its base in `bases`.
    pub base: usize,
    pub rank: usize,
    /// Stored bytes of its U blocks and Vᵀ (its base not included).
    pub bytes: u64,
    /// (bytes + its base's bytes / layers sharing it) · 8 / weights.
    pub bits_per_weight: f64,
    /// ‖W−Ŵ‖/‖W‖ of what is stored.
    pub rel_err: f64,
    /// ‖W−B̂‖/‖W‖ (the error with the delta dropped).
    pub base_rel_err: f64,
    /// Cosine similarity with the same type's matrix of the previous layer.
    pub cos_prev: Option<f64>,
    /// Cosine similarity with its base (the unquantized cluster mean).
    pub cos_base: f64,
    /// Smallest rank whose SVD tail of W−B̂ is within each threshold (key: threshold).
    pub tail_ranks: BTreeMap<String, usize>,
    /// Set when --max-rel-err could not be met at full rank.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

#[derive(Clone, Debug, Serialize)]
pub struct BaseReport {
    #[serde(rename = "type")]
    pub ty: String,
    pub cluster: u32,
    pub layers: Vec<u32>,
    pub bytes: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct PassReport {
    pub name: String,
    pub shape: Vec<u64>,
    pub codec: String,
    pub bytes: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct DeltaReport {
    pub options: serde_json::Value,
    pub matrices: Vec<MatrixReport>,
    pub bases: Vec<BaseReport>,
    pub passthrough: Vec<PassReport>,
    pub archive_bytes: u64,
    pub total_weights: u64,
    /// Archive bytes · 8 / all weights.
    pub bits_per_weight: f64,
    /// Weights in delta matrices, and (their U/Vᵀ + all bases) · 8 / those weights.
    pub delta_weights: u64,
    pub delta_bits_per_weight: f64,
    /// Over delta matrices, weighted by element count.
    pub mean_rel_err: f64,
    pub max_rel_err: f64,
    /// Matrices whose --max-rel-err bound full rank could not meet.
    pub unreachable: usize,
}

enum Plan {
    Pass,
    Delta {
        base: u32,
        enc: Box<EncodedDelta>,
        report: MatrixReport,
    },
}

/// Convert `src` into a delta archive at `out`. `progress(done, total, what)` after each
/// weight type and each tensor written.
pub fn convert(
    src: &dyn SourceModel,
    out: &Path,
    opts: &DeltaOptions,
    progress: &(dyn Fn(usize, usize, &str) + Sync),
) -> Result<DeltaReport, ConvertError> {
    opts.validate()?;
    let desc = src.desc();
    let n = desc.tensors.len();
    let total_steps = WEIGHT_TYPES.len() + n;
    let groups = group_by_type(desc);

    let mut writer = DeltaWriter::create(out, opts.compression)?;
    writer.set_min_saving(opts.min_saving);
    let mut plans: Vec<Plan> = (0..n).map(|_| Plan::Pass).collect();
    let mut base_reports = Vec::new();
    for (ty, group) in groups.iter().enumerate() {
        progress(ty + 1, total_steps, WEIGHT_TYPES[ty]);
        if !group.is_empty() {
            let mut out = Planned {
                writer: &mut writer,
                plans: &mut plans,
                bases: &mut base_reports,
            };
            encode_type(src, opts, ty, group, &mut out)?;
        }
    }
    let written = |i: usize, name: &str| progress(WEIGHT_TYPES.len() + i + 1, total_steps, name);
    let (matrices, passthrough) = write_tensors(src, plans, &base_reports, &mut writer, &written)?;
    let mut report = summarize(desc, opts, matrices, base_reports, passthrough);
    let extra = serde_json::json!({
        "convert": report.options,
        "rel_err": report.matrices.iter().map(|m| (m.name.clone(), serde_json::json!(m.rel_err)))
            .collect::<serde_json::Map<String, serde_json::Value>>(),
        "report": report,
    });
    let routing = crate::convert::routing_bytes(src)?;
    report.archive_bytes = writer.finish(desc, opts.base_dtype, extra, &routing)?;
    report.bits_per_weight = report.archive_bytes as f64 * 8.0 / report.total_weights.max(1) as f64;
    // Prove the archive opens before reporting success.
    crate::archive::delta::DeltaArchive::open(out)?;
    Ok(report)
}

fn wrap(name: &str, source: CodecError) -> ConvertError {
    ConvertError::Codec {
        tensor: name.to_string(),
        source,
    }
}

/// The seven projections' tensors by type, as (layer, tensor index) in layer order; a
/// type is delta-coded when all its layers' matrices are 2-D with one shape, otherwise
/// its group is left empty (its tensors are stored as passthrough).
fn group_by_type(desc: &ModelDesc) -> Vec<Vec<(u32, usize)>> {
    let mut groups: Vec<Vec<(u32, usize)>> = vec![Vec::new(); WEIGHT_TYPES.len()];
    for (i, t) in desc.tensors.iter().enumerate() {
        if let Some((layer, ty)) = weight_type_of(&t.name) {
            groups[ty].push((layer, i));
        }
    }
    for (ty, g) in groups.iter_mut().enumerate() {
        g.sort();
        let shapes: Vec<&Vec<u64>> = g.iter().map(|&(_, i)| &desc.tensors[i].shape).collect();
        if shapes.iter().any(|s| s.len() != 2 || *s != shapes[0]) {
            tracing::warn!(
                "{}: layers differ in shape; stored as passthrough",
                WEIGHT_TYPES[ty]
            );
            g.clear();
        }
    }

    groups
}

/// Where [`encode_type`] puts its results: bases go to the writer now, deltas are
/// planned for writing in model order.
struct Planned<'a> {
    writer: &'a mut DeltaWriter,
    plans: &'a mut [Plan],
    bases: &'a mut Vec<BaseReport>,
}

/// One weight type: bases (k-means over its layers, quantized and stored) and each
/// layer's low-rank delta against its base.
fn encode_type(
    src: &dyn SourceModel,
    opts: &DeltaOptions,
    ty: usize,
    group: &[(u32, usize)],
    out: &mut Planned,
) -> Result<(), ConvertError> {
    let desc = src.desc();
    let t0 = &desc.tensors[group[0].1];
    let (rows, cols) = (t0.rows() as usize, t0.cols() as usize);
    let rpb = rows_per_block(t0);
    let ws: Vec<Vec<f32>> = group
        .par_iter()
        .map(|&(_, i)| src.f32(i))
        .collect::<Result<_, _>>()?;
    let refs: Vec<&[f32]> = ws.iter().map(Vec::as_slice).collect();
    let (assign, means) = decompose::cluster_layers(&refs, opts.bases, opts.kmeans_iters);
    // Bases: quantize, store, keep B̂ for the residuals.
    let mut stored_bases = Vec::with_capacity(means.len());
    for (c, mean) in means.iter().enumerate() {
        let layers: Vec<u32> = group
            .iter()
            .zip(&assign)
            .filter(|(_, &a)| a == c)
            .map(|(&(l, _), _)| l)
            .collect();
        let (deq, blocks) = decompose::encode_base(mean, rows, cols, rpb as usize, opts.base_dtype);
        let (idx, bytes) = out.writer.add_base(
            WEIGHT_TYPES[ty],
            c as u32,
            layers.clone(),
            rows as u64,
            cols as u64,
            rpb,
            &blocks,
        )?;
        out.bases.push(BaseReport {
            ty: WEIGHT_TYPES[ty].to_string(),
            cluster: c as u32,
            layers,
            bytes,
        });
        stored_bases.push((idx, deq));
    }
    let encoded: Vec<Result<EncodedDelta, ConvertError>> = (0..group.len())
        .into_par_iter()
        .map(|m| {
            let name = &desc.tensors[group[m].1].name;
            decompose::decompose(
                &ws[m],
                &stored_bases[assign[m]].1,
                rows,
                cols,
                rpb as usize,
                opts.rank,
            )
            .map_err(|e| wrap(name, e))
        })
        .collect();
    let cos: Vec<(Option<f64>, f64)> = (0..group.len())
        .into_par_iter()
        .map(|m| {
            let prev = (m > 0 && group[m - 1].0 + 1 == group[m].0)
                .then(|| decompose::cosine(&ws[m], &ws[m - 1]));
            (prev, decompose::cosine(&ws[m], &means[assign[m]]))
        })
        .collect();
    for (m, (enc, (cos_prev, cos_base))) in encoded.into_iter().zip(cos).enumerate() {
        let enc = enc?;
        let (layer, i) = group[m];
        let report = MatrixReport {
            name: desc.tensors[i].name.clone(),
            layer,
            ty: type_label(WEIGHT_TYPES[ty]).to_string(),
            base: stored_bases[assign[m]].0 as usize,
            rank: enc.rank,
            bytes: 0,
            bits_per_weight: 0.0,
            rel_err: enc.rel_err,
            base_rel_err: enc.base_rel_err,
            cos_prev,
            cos_base,
            tail_ranks: TAIL_THRESHOLDS
                .iter()
                .zip(&enc.tail_ranks)
                .map(|(t, &r)| (format!("{t}"), r))
                .collect(),
            note: enc
                .unreachable
                .then(|| "--max-rel-err not reachable at full rank with f16 factors".to_string()),
        };
        out.plans[i] = Plan::Delta {
            base: stored_bases[assign[m]].0,
            enc: Box::new(enc),
            report,
        };
    }
    Ok(())
}

/// Write every tensor in model order (one layer's deltas lie together): passthrough
/// tensors are read and encoded now, deltas were planned by [`encode_type`].
fn write_tensors(
    src: &dyn SourceModel,
    plans: Vec<Plan>,
    base_reports: &[BaseReport],
    writer: &mut DeltaWriter,
    written: &dyn Fn(usize, &str),
) -> Result<(Vec<MatrixReport>, Vec<PassReport>), ConvertError> {
    let desc = src.desc();
    let mut matrices = Vec::new();
    let mut passthrough = Vec::new();
    for (i, plan) in plans.into_iter().enumerate() {
        let t = &desc.tensors[i];
        let rpb = rows_per_block(t);
        match plan {
            Plan::Pass => {
                let raw = src.raw(i)?;
                let enc = codec::encode_passthrough(&raw, t.source, t.rows(), t.cols(), rpb)
                    .map_err(|e| wrap(&t.name, e))?;
                drop(raw);
                let bytes = writer.add_passthrough(i, &t.name, t.source, rpb, &enc.blocks)?;
                passthrough.push(PassReport {
                    name: t.name.clone(),
                    shape: t.shape.clone(),
                    codec: crate::codec::codec_label(&enc.codec),
                    bytes,
                });
            }
            Plan::Delta {
                base,
                enc,
                mut report,
            } => {
                report.bytes = writer.add_delta(
                    i,
                    &t.name,
                    base,
                    enc.rank as u64,
                    rpb,
                    &enc.u_blocks,
                    &enc.vt,
                )?;
                let b = &base_reports[report.base];
                let share = b.bytes as f64 / b.layers.len().max(1) as f64;
                report.bits_per_weight =
                    (report.bytes as f64 + share) * 8.0 / t.numel().max(1) as f64;
                matrices.push(report);
            }
        }
        written(i, &t.name);
    }

    Ok((matrices, passthrough))
}

/// The report's totals over what was written (archive size filled in after `finish`).
fn summarize(
    desc: &ModelDesc,
    opts: &DeltaOptions,
    matrices: Vec<MatrixReport>,
    base_reports: Vec<BaseReport>,
    passthrough: Vec<PassReport>,
) -> DeltaReport {
    let total_weights: u64 = desc.tensors.iter().map(|t| t.numel()).sum();
    let numel = |name: &str| {
        desc.tensor_index(name)
            .map_or(0, |i| desc.tensors[i].numel())
    };
    let delta_weights: u64 = matrices.iter().map(|m| numel(&m.name)).sum();
    let delta_bytes: u64 = matrices.iter().map(|m| m.bytes).sum::<u64>()
        + base_reports.iter().map(|b| b.bytes).sum::<u64>();
    let (mut err_w, mut max_rel_err) = (0.0, 0.0f64);
    for m in &matrices {
        err_w += m.rel_err * numel(&m.name) as f64;
        max_rel_err = max_rel_err.max(m.rel_err);
    }
    DeltaReport {
        options: opts.to_json(),
        unreachable: matrices.iter().filter(|m| m.note.is_some()).count(),
        mean_rel_err: if delta_weights > 0 {
            err_w / delta_weights as f64
        } else {
            0.0
        },
        max_rel_err,
        delta_bits_per_weight: delta_bytes as f64 * 8.0 / delta_weights.max(1) as f64,
        delta_weights,
        matrices,
        bases: base_reports,
        passthrough,
        archive_bytes: 0,
        total_weights,
        bits_per_weight: 0.0,
    }
}
