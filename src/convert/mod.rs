//! The conversion pipelines: source model → codec per tensor → archive. This file holds
//! the `.cawsf` pipeline and what every kind's pipeline shares (errors, the report,
//! encoding in windows, the ROUTING bytes); [`delta`] and [`npydir`] hold the others.
//!
//! Tensors are encoded in parallel (rayon) in windows and written in model order, so
//! the archive bytes do not depend on the thread count. Each tensor's k-means seed is
//! derived from the user's seed and the tensor name for the same reason.

use std::path::Path;

use globset::{Glob, GlobSet, GlobSetBuilder};
use serde::Serialize;
use xxhash_rust::xxh3::xxh3_64;

use crate::archive::cawsf::CawsfWriter;
use crate::archive::container::rows_per_block;
use crate::archive::Compression;
use crate::codec::{self, codec_label, CodecError, EncodedTensor, NdsqOptions};
use crate::import::SourceModel;
use crate::model::TensorDesc;

pub mod bpw;
pub mod calibrate;
pub use bpw::SensitivityUse;
pub mod delta;
pub mod npydir;

#[derive(Clone, Debug)]
pub struct ConvertOptions {
    pub ndsq: NdsqOptions,
    /// Tensors whose name matches one of these glob patterns ([`Patterns`]) are stored
    /// as compressed passthrough (bit-exact). Tensors that are not 2-D float matrices of at least 8 rows always are.
    pub passthrough: Vec<String>,
    pub compression: Compression,
    /// A block keeps its compressed form only where that saves this fraction of its
    /// bytes (0: any saving); raw blocks skip decompression on every read.
    pub min_saving: f64,
    /// Tensors encoded at once; bounds peak memory.
    pub window: usize,
    /// (pattern, scalar R): the scalar R of the tensors matching the pattern instead of
    /// `ndsq.sq`, first match first (used only when `ndsq.sq` is set).
    pub sq_for: Vec<(String, codec::SqParams)>,
    /// Weights every NDSQ fit by the importance of each input column (docs/IMATRIX.md).
    pub imatrix: Option<std::sync::Arc<crate::import::imatrix::Imatrix>>,
    /// Average bits per weight of the whole archive: each tensor's scalar R (or its
    /// source bytes) is chosen to meet it ([`bpw`]); `sq` and `sq_for` are then unused.
    pub bpw: Option<f64>,
    /// When `bpw` is below the smallest archive the model allows (tensors `passthrough`
    /// keeps whole), plan that smallest archive instead of failing: for a target the
    /// user did not choose ([`DEFAULT_BPW`]).
    pub bpw_at_least_floor: bool,
    /// `bpw` plans NDSQ's scalar groups instead of ggml block types.
    pub bpw_sq: bool,
    /// (pattern, type): the tensors matching the pattern are rounded into that ggml
    /// type instead of the one `bpw` would choose, first match first (`bpw` only).
    pub type_for: Vec<(String, crate::gguf::GgmlType)>,
    /// The ggml types `bpw` may choose from (None: every type cawsfs rounds into);
    /// `type_for` may name others.
    pub bpw_types: Option<Vec<crate::gguf::GgmlType>>,
    /// Second moments of each layer's inputs (`--calibration`): tensors rounded into
    /// ggml types get error feedback across columns from them.
    pub calibration: Option<std::sync::Arc<crate::import::calibration::Calibration>>,
    /// Without `calibration`, the text cawsfs runs the model over to gather those
    /// statistics itself ([`calibrate`]); None: no error feedback.
    pub self_calibration: Option<calibrate::SelfCalibration>,
    /// Tokens of `self_calibration`'s text over which `bpw` measures how much each
    /// tensor's error moves the output ([`calibrate::probe`]); 0: every tensor's
    /// relative error counts alike.
    pub sensitivity_tokens: usize,
}

/// `cawsfs convert`'s bits-per-weight target when no R is chosen: where NDSQ's
/// KL-divergence on the test model falls below Q4_K_M's at fewer bits (docs/QUALITY.md).
pub const DEFAULT_BPW: f64 = 5.0;

impl Default for ConvertOptions {
    fn default() -> Self {
        ConvertOptions {
            ndsq: NdsqOptions {
                // Measured on SmolLM2-135M (docs/QUALITY.md): PQ of 2-wide sub-vectors
                // sets the error (~9%); rank 4 costs ~0.2 bits per weight.
                rank: 4,
                outlier_q: 0.999,
                pq_dim: 2,
                pq_m: None,
                pq_k: 256,
                kmeans_iters: 12,
                seed: 0,
                sq: None,
            },
            passthrough: vec!["model.embed_tokens.weight".into(), "lm_head.weight".into()],
            compression: Compression::Zstd(3),
            min_saving: 0.0,
            window: 8,
            sq_for: Vec::new(),
            imatrix: None,
            bpw: None,
            bpw_at_least_floor: false,
            bpw_sq: false,
            type_for: Vec::new(),
            bpw_types: None,
            calibration: None,
            self_calibration: Some(calibrate::SelfCalibration::bundled()),
            sensitivity_tokens: calibrate::probe::DEFAULT_TOKENS,
        }
    }
}

impl ConvertOptions {
    /// Reject options no tensor could be coded with, before any work starts (so that
    /// a per-tensor NDSQ parameter error can only mean "this tensor's shape or values").
    pub fn validate(&self) -> Result<(), ConvertError> {
        let o = &self.ndsq;
        let bad = |m: String| Err(ConvertError::Options(m));
        if (1..calibrate::MIN_TOKENS).contains(&self.sensitivity_tokens) {
            return bad(format!(
                "--sensitivity-tokens {}: 0 (off) or at least {} tokens",
                self.sensitivity_tokens,
                calibrate::MIN_TOKENS
            ));
        }
        if let Some(b) = self.bpw {
            if !(b.is_finite() && b > 0.0) {
                return bad(format!("--bpw {b} is not a positive number"));
            }
        }
        if !(0.0..=1.0).contains(&self.min_saving) {
            return bad(format!("--min-saving {} is not in [0, 1]", self.min_saving));
        }
        if !(0.0..=1.0).contains(&o.outlier_q) {
            return bad(format!("--outlier-q {} is not in [0, 1]", o.outlier_q));
        }
        if !(1..=256).contains(&o.pq_k) {
            return bad(format!(
                "--pq-k {} is not in 1..=256 (codes are one byte)",
                o.pq_k
            ));
        }
        if o.pq_dim == 0 || o.pq_m == Some(0) {
            return bad("--pq-dim and --pq-m must be at least 1".into());
        }
        if let Some(sq) = o.sq {
            for s in std::iter::once(sq).chain(self.sq_for.iter().map(|r| r.1)) {
                if !(1..=8).contains(&s.bits) {
                    return bad(format!("scalar R bits {} is not in 1..=8", s.bits));
                }
                if s.group == 0 {
                    return bad("scalar R groups must hold at least 1 value".into());
                }
            }
        }
        self.sq_rules()?;
        self.type_rules()?;
        Patterns::new(&self.passthrough).map(drop)
    }

    /// `sq_for`'s patterns, compiled once per conversion.
    fn sq_rules(&self) -> Result<Vec<(Patterns, codec::SqParams)>, ConvertError> {
        self.sq_for
            .iter()
            .map(|(p, r)| Ok((Patterns::of_flag(std::slice::from_ref(p), "--sq-for")?, *r)))
            .collect()
    }

    /// `type_for`'s patterns, compiled once per plan; a type the fits cannot write is
    /// an options error.
    pub(crate) fn type_rules(
        &self,
    ) -> Result<Vec<(Patterns, crate::gguf::GgmlType)>, ConvertError> {
        self.type_for
            .iter()
            .map(|(p, ty)| {
                if !crate::gguf::fit::can_fit(*ty) {
                    return Err(ConvertError::Options(format!(
                        "--type-for {p}={}: cawsfs cannot round into that type",
                        codec::format_label(crate::model::SourceType::Ggml(*ty))
                    )));
                }
                Ok((
                    Patterns::of_flag(std::slice::from_ref(p), "--type-for")?,
                    *ty,
                ))
            })
            .collect()
    }

    /// The NDSQ options of tensor `name`: its scalar R rule (from [`Self::sq_rules`])
    /// and its own seed.
    fn ndsq_for(&self, name: &str, rules: &[(Patterns, codec::SqParams)]) -> NdsqOptions {
        let mut nd = self.ndsq.clone();
        nd.seed = self.ndsq.seed ^ xxh3_64(name.as_bytes());
        if let Some(sq) = nd.sq.as_mut() {
            if let Some((_, r)) = rules.iter().find(|(p, _)| p.is_match(name)) {
                *sq = *r;
            }
        }
        nd
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConvertError {
    #[error("invalid options: {0}")]
    Options(String),
    /// Reading the source or writing the archive failed.
    #[error(transparent)]
    File(#[from] crate::error::FileError),
    #[error("tensor {tensor}: {source}")]
    Codec {
        tensor: String,
        #[source]
        source: CodecError,
    },
}

#[derive(Clone, Debug, Serialize)]
pub struct TensorReport {
    pub name: String,
    pub shape: Vec<u64>,
    pub codec: String,
    /// Stored bytes (after block compression) of the tensor's global blob and blocks.
    pub bytes: u64,
    pub bits_per_weight: f64,
    pub rel_err: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct ConvertReport {
    pub tensors: Vec<TensorReport>,
    pub archive_bytes: u64,
    pub total_weights: u64,
    pub bits_per_weight: f64,
    /// Weighted by element count over NDSQ-coded tensors.
    pub mean_rel_err: f64,
    pub max_rel_err: f64,
    /// How an importance matrix was used, when one was given.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub imatrix: Option<ImatrixUse>,
    /// The `--bpw` target and the planned figure (before block compression), when given.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bpw: Option<BpwUse>,
    /// Where the error feedback's statistics came from, when any tensor could use them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub calibration: Option<CalibrationUse>,
    /// The measured sensitivities the plan used, when `--bpw` measured them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sensitivity: Option<SensitivityUse>,
}

/// The statistics error feedback used: a file's, or those of cawsfs's own forward pass.
#[derive(Clone, Debug, Serialize)]
pub struct CalibrationUse {
    /// The file, or the text the pass ran over.
    pub source: String,
    pub tokens: u64,
    /// Time spent in the forward pass (0 for a file).
    pub seconds: f64,
    /// Why the pass could not run this model (then no tensor got feedback).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub skipped: Option<String>,
}

#[derive(Clone, Debug, Serialize)]
pub struct BpwUse {
    pub target: f64,
    pub planned: f64,
    /// The target was below the smallest archive the model allows, which was planned
    /// instead (`bpw_at_least_floor`).
    pub at_floor: bool,
}

/// What `--imatrix` weighted: its entries against the tensors the model codes.
#[derive(Clone, Debug, Serialize)]
pub struct ImatrixUse {
    pub path: String,
    pub entries: usize,
    pub chunks: Option<u64>,
    /// Coded tensors fitted with its weights.
    pub weighted: usize,
    /// Coded tensors it has no entry for (fitted unweighted).
    pub unweighted: Vec<String>,
}

impl ConvertReport {
    /// Totals over `tensors` (model order): bits per weight of the whole archive, and
    /// the element-weighted mean and the max of `rel_err` over the tensors that
    /// `counted(i, report)` says were coded lossily.
    pub fn new(
        tensors: Vec<TensorReport>,
        archive_bytes: u64,
        desc: &crate::model::ModelDesc,
        counted: impl Fn(usize, &TensorReport) -> bool,
    ) -> ConvertReport {
        let total_weights: u64 = desc.tensors.iter().map(|t| t.numel()).sum();
        let (mut err_w, mut err_n, mut max_rel_err) = (0.0, 0u64, 0.0f64);
        for (i, (r, t)) in tensors.iter().zip(&desc.tensors).enumerate() {
            if counted(i, r) {
                err_w += r.rel_err * t.numel() as f64;
                err_n += t.numel();
                max_rel_err = max_rel_err.max(r.rel_err);
            }
        }
        ConvertReport {
            tensors,
            archive_bytes,
            total_weights,
            bits_per_weight: archive_bytes as f64 * 8.0 / total_weights.max(1) as f64,
            mean_rel_err: if err_n > 0 { err_w / err_n as f64 } else { 0.0 },
            imatrix: None,
            bpw: None,
            calibration: None,
            sensitivity: None,
            max_rel_err,
        }
    }
}

/// Tensor-name patterns (`--passthrough`), compiled once. They are globs: `*` matches
/// any run of characters, dots included (globset's default, `literal_separator` off);
/// `?`, `[...]` and `{a,b}` are special too, which tensor names never contain.
pub struct Patterns(GlobSet);

impl Patterns {
    /// An invalid pattern is a one-line options error naming it.
    pub fn new(patterns: &[String]) -> Result<Patterns, ConvertError> {
        Self::of_flag(patterns, "--passthrough")
    }

    /// Patterns given with `flag`, which an error names.
    pub fn of_flag(patterns: &[String], flag: &str) -> Result<Patterns, ConvertError> {
        let mut set = GlobSetBuilder::new();
        for p in patterns {
            let glob = Glob::new(p).map_err(|e| {
                ConvertError::Options(format!("{flag} pattern {p:?}: {}", e.kind()))
            })?;
            set.add(glob);
        }
        let set = set
            .build()
            .map_err(|e| ConvertError::Options(format!("{flag} patterns: {e}")))?;
        Ok(Patterns(set))
    }

    pub fn is_match(&self, name: &str) -> bool {
        self.0.is_match(name)
    }
}

/// Fewest rows a tensor needs to be coded: a smaller matrix (BERT's two token-type
/// embeddings) costs more in codec overhead than it saves.
const MIN_CODED_ROWS: u64 = 8;

/// Whether `t` keeps its source bytes: anything but a 2-D float matrix of at least
/// [`MIN_CODED_ROWS`] rows (biases, norms, integer ids, convolution kernels), and the
/// `--passthrough` patterns.
fn is_passthrough(t: &TensorDesc, pass: &Patterns) -> bool {
    t.shape.len() != 2
        || t.rows() < MIN_CODED_ROWS
        || !t.source.is_float()
        || pass.is_match(&t.name)
}

/// Checks `--imatrix` against the tensors to be coded before any work: an entry of the
/// wrong length, or no entry for any of them, is an error naming the file.
fn imatrix_use(
    m: &crate::import::imatrix::Imatrix,
    desc: &crate::model::ModelDesc,
    pass: &Patterns,
) -> Result<ImatrixUse, ConvertError> {
    let coded: Vec<&TensorDesc> = desc
        .tensors
        .iter()
        .filter(|t| !is_passthrough(t, pass))
        .collect();
    let mut unweighted = Vec::new();
    for t in &coded {
        if m.for_tensor(&t.name, t.cols())?.is_none() {
            unweighted.push(t.name.clone());
        }
    }
    if !coded.is_empty() && unweighted.len() == coded.len() {
        return Err(crate::error::FileError::invalid(
            m.path(),
            format!(
                "none of its {} entries names a tensor this model codes (an importance matrix of another model?)",
                m.len()
            ),
        )
        .into());
    }
    Ok(ImatrixUse {
        path: m.path().display().to_string(),
        entries: m.len(),
        chunks: m.chunks,
        weighted: coded.len() - unweighted.len(),
        unweighted,
    })
}

/// Checks `--calibration` against the tensors to be coded before any work: statistics
/// of the wrong width, or none for any of them, are an error naming the file.
fn calibration_use(
    c: &crate::import::calibration::Calibration,
    desc: &crate::model::ModelDesc,
    pass: &Patterns,
) -> Result<(), ConvertError> {
    let mut covered = 0;
    let mut coded = 0;
    for t in desc.tensors.iter().filter(|t| !is_passthrough(t, pass)) {
        coded += 1;
        covered += c.covers(&t.name, t.cols())? as usize;
    }
    if coded > 0 && covered == 0 {
        return Err(crate::error::FileError::invalid(
            c.path(),
            format!(
                "none of its {} entries names a tensor this model codes (statistics of another model?)",
                c.len()
            ),
        )
        .into());
    }
    Ok(())
}

fn encode_one(
    src: &dyn SourceModel,
    i: usize,
    opts: &ConvertOptions,
    pass: &Patterns,
    sq_rules: &[(Patterns, codec::SqParams)],
    plan: Option<&bpw::Plan>,
    h: Option<&[f32]>,
) -> Result<EncodedTensor, ConvertError> {
    let t = &src.desc().tensors[i];
    let rpb = rows_per_block(t);
    let wrap = |source| ConvertError::Codec {
        tensor: t.name.clone(),
        source,
    };
    let choice = plan.map(|p| p.choices[i]);
    let imp = || -> Result<_, ConvertError> {
        Ok(match &opts.imatrix {
            Some(m) => m.for_tensor(&t.name, t.cols())?,
            None => None,
        })
    };
    if is_passthrough(t, pass) || choice == Some(bpw::Choice::Source) {
        let raw = src.raw(i)?;
        codec::encode_passthrough(&raw, t.source, t.rows(), t.cols(), rpb).map_err(wrap)
    } else if let Some(bpw::Choice::Ggml(ty)) = choice {
        let w = src.f32(i)?;
        let file_h = match (&opts.calibration, h) {
            (Some(c), None) => c.for_tensor(&t.name, t.cols())?,
            _ => None,
        };
        let enc = match h.or(file_h.as_deref()) {
            Some(h) => codec::encode_ggml_feedback(&w, t.rows(), t.cols(), rpb, ty, h),
            None => codec::encode_ggml(&w, t.rows(), t.cols(), rpb, ty, imp()?),
        };
        // Planes are zstd frames: only where the archive compresses with zstd anyway.
        match opts.compression {
            Compression::Zstd(_) => enc.and_then(codec::into_planes),
            _ => enc,
        }
        .map_err(wrap)
    } else {
        let w = src.f32(i)?;
        let mut nd = opts.ndsq_for(&t.name, sq_rules);
        if let Some(bpw::Choice::Sq(p)) = choice {
            nd.sq = Some(p);
        }
        let enc = match imp()? {
            Some(imp) => codec::encode_ndsq_weighted(&w, t.rows(), t.cols(), rpb, &nd, imp),
            None => codec::encode_ndsq(&w, t.rows(), t.cols(), rpb, &nd),
        };
        match enc {
            // A width the sub-vectors don't divide, or non-finite values: NDSQ cannot
            // code this tensor, so keep it exact rather than fail the whole model.
            Err(CodecError::Params(why)) => {
                tracing::warn!("{}: stored as passthrough ({why})", t.name);
                let raw = src.raw(i)?;
                codec::encode_passthrough(&raw, t.source, t.rows(), t.cols(), rpb).map_err(wrap)
            }
            r => r.map_err(wrap),
        }
    }
}

/// Encode tensors `0..n` in parallel, `window` at a time (bounding how many encoded
/// tensors are held at once), handing each to `take` in order.
pub(crate) fn in_windows<T: Send, E: Send>(
    n: usize,
    window: usize,
    encode: impl Fn(usize) -> Result<T, E> + Sync,
    mut take: impl FnMut(usize, T) -> Result<(), E>,
) -> Result<(), E> {
    use rayon::prelude::*;
    let window = window.max(1);
    let mut start = 0;
    while start < n {
        let end = (start + window).min(n);
        let batch: Vec<Result<T, E>> = (start..end).into_par_iter().map(&encode).collect();
        for (i, r) in (start..end).zip(batch) {
            take(i, r?)?;
        }
        start = end;
    }
    Ok(())
}

/// Convert `src` into an archive at `out`. `progress(done, total, name)` is called
/// after each tensor is written.
pub fn convert(
    src: &dyn SourceModel,
    out: &Path,
    opts: &ConvertOptions,
    progress: &(dyn Fn(usize, usize, &str) + Sync),
) -> Result<ConvertReport, ConvertError> {
    opts.validate()?;
    let pass = Patterns::new(&opts.passthrough)?;
    let sq_rules = opts.sq_rules()?;
    let desc = src.desc();
    let imatrix = match &opts.imatrix {
        Some(m) => Some(imatrix_use(m, desc, &pass)?),
        None => None,
    };
    if let Some(c) = &opts.calibration {
        calibration_use(c, desc, &pass)?;
    }
    let n = desc.tensors.len();
    let mut writer = CawsfWriter::create(out, opts.compression)?;
    writer.set_min_saving(opts.min_saving);
    let routing = routing_bytes(src)?;
    let (mut sensitivity, mut measured) = (None, None);
    let mut measure = || {
        let (used, s) = bpw::measure_sensitivity(src, opts, &pass)?;
        sensitivity = used;
        measured = s.clone();
        Ok(s)
    };
    let plan = match opts.bpw {
        Some(target) => Some(bpw::plan(
            src,
            opts,
            &pass,
            target,
            reserved_bytes(desc, routing.len())?,
            &mut measure,
            progress,
        )?),
        None => None,
    };
    let mut forward = None;
    let mut calibration = opts.calibration.as_ref().map(|c| CalibrationUse {
        source: c.path().display().to_string(),
        tokens: c.tokens,
        seconds: 0.0,
        skipped: None,
    });
    // The tensors rounded into ggml types: only their inputs' moments are gathered.
    let needs: std::collections::HashSet<String> = match &plan {
        Some(p) => (p.choices.iter().zip(&desc.tensors))
            .filter(|(c, _)| matches!(c, bpw::Choice::Ggml(_)))
            .map(|(_, t)| t.name.clone())
            .collect(),
        None => Default::default(),
    };
    if let (None, Some(cal), false) = (&opts.calibration, &opts.self_calibration, needs.is_empty())
    {
        let t0 = std::time::Instant::now();
        let f = calibrate::Forward::new(src, cal, Some(needs))?;
        calibration = Some(CalibrationUse {
            source: cal.label.clone(),
            tokens: f.as_ref().map_or(0, |f| f.tokens as u64),
            seconds: t0.elapsed().as_secs_f64(),
            skipped: f.as_ref().err().cloned(),
        });
        forward = f.ok();
    }
    // With the pass, tensors are encoded in its order (a layer's once its statistics
    // exist, which are dropped after it); else in model order, all as one group.
    let groups: Vec<(calibrate::Step, Vec<usize>)> = match &forward {
        Some(_) => calibrate::pass_order(desc),
        None => vec![(calibrate::Step::None, (0..n).collect())],
    };
    let mut reports: Vec<Option<TensorReport>> = vec![None; n];
    let mut done = 0;
    for (step, members) in groups {
        let t0 = std::time::Instant::now();
        let moments = match (&mut forward, step) {
            (Some(f), calibrate::Step::Layer(l)) => f.layer(l)?,
            (Some(f), calibrate::Step::Head) => f.head()?,
            _ => calibrate::Moments::new(),
        };
        if let (Some(c), Some(_)) = (&mut calibration, &forward) {
            c.seconds += t0.elapsed().as_secs_f64();
        }
        in_windows(
            members.len(),
            opts.window,
            |j| {
                let i = members[j];
                let h = moments.get(&desc.tensors[i].name).map(|h| h.as_slice());
                encode_one(src, i, opts, &pass, &sq_rules, plan.as_ref(), h)
            },
            |j, enc: EncodedTensor| {
                let i = members[j];
                let t = &desc.tensors[i];
                let rpb = rows_per_block(t);
                writer.add_tensor(i, rpb, &enc)?;
                reports[i] = Some(TensorReport {
                    name: t.name.clone(),
                    shape: t.shape.clone(),
                    codec: codec_label(&enc.codec),
                    bytes: 0,
                    bits_per_weight: 0.0,
                    rel_err: enc.rel_err,
                });
                done += 1;
                progress(done, n, &t.name);
                Ok(())
            },
        )?;
    }
    let mut reports: Vec<TensorReport> = reports.into_iter().flatten().collect();
    let extra = serde_json::json!({
        "convert": {
            "rank": opts.ndsq.rank,
            "outlier_q": opts.ndsq.outlier_q,
            "pq_dim": opts.ndsq.pq_dim,
            "pq_m": opts.ndsq.pq_m,
            "pq_k": opts.ndsq.pq_k,
            "kmeans_iters": opts.ndsq.kmeans_iters,
            "seed": opts.ndsq.seed,
            "passthrough": opts.passthrough,
            "imatrix": imatrix.as_ref().map(|u| serde_json::json!({
                "path": u.path, "entries": u.entries, "chunks": u.chunks, "weighted": u.weighted,
            })),
            "bpw": opts.bpw,
            "calibration": calibration.as_ref().map(|c| serde_json::json!({
                "source": c.source, "tokens": c.tokens, "skipped": c.skipped,
            })),
            "sensitivity": sensitivity.as_ref().map(|s| serde_json::json!({
                "tokens": s.tokens, "tensors": s.tensors, "skipped": s.skipped,
                // Mean KLD per unit of relative squared error, as the plan used it.
                "per_tensor": measured.as_ref().map(|m| {
                    let mut v: Vec<_> = m.per_tensor.iter().collect();
                    v.sort_by(|a, b| a.0.cmp(b.0));
                    v.into_iter().map(|(k, c)| (k.clone(), serde_json::json!(c)))
                        .collect::<serde_json::Map<String, serde_json::Value>>()
                }),
            })),
        },
        "rel_err": reports.iter().map(|r| (r.name.clone(), serde_json::json!(r.rel_err))).collect::<serde_json::Map<String, serde_json::Value>>(),
    });
    let archive_bytes = writer.finish(desc, extra, &routing)?;
    // Stored sizes come from the archive as written, which also proves it opens.
    let archive = crate::archive::cawsf::CawsfArchive::open(out)?;
    for (i, r) in reports.iter_mut().enumerate() {
        r.bytes = archive.tensor_info(i).stored_bytes;
        r.bits_per_weight = r.bytes as f64 * 8.0 / desc.tensors[i].numel().max(1) as f64;
    }
    let mut report = ConvertReport::new(reports, archive_bytes, desc, |_, r| {
        !r.codec.starts_with("passthrough")
    });
    report.imatrix = imatrix;
    report.calibration = calibration;
    report.sensitivity = sensitivity;
    report.bpw = plan.map(|p| BpwUse {
        target: p.target_bpw,
        planned: p.planned_bpw,
        at_floor: p.at_floor,
    });
    Ok(report)
}

/// What an archive of `desc` spends outside its tensors, estimated for `--bpw`: the
/// header page and up to a page of alignment before each of the five sections, META
/// (the model description, zstd-compressed as the writer does) and ROUTING (`routing`
/// bytes), and per tensor its META entry and global reference.
fn reserved_bytes(desc: &crate::model::ModelDesc, routing: usize) -> Result<u64, ConvertError> {
    let json = serde_json::to_vec(desc)
        .map_err(|e| ConvertError::Options(format!("describing the model: {e}")))?;
    let meta = zstd::bulk::compress(&json, crate::archive::container::META_ZSTD_LEVEL)
        .map_or(json.len(), |z| z.len());
    Ok(6 * 4096 + meta as u64 + routing as u64 + 512 * desc.tensors.len() as u64)
}

/// The ROUTING bytes (docs/FORMAT.md §7, docs/ROUTER.md) every archive kind stores
/// for `src`: embedding blocks sized to the mount's default chunk, keyed by their tokens.
pub fn routing_bytes(src: &dyn SourceModel) -> Result<Vec<u8>, ConvertError> {
    let r = crate::router::build_routing(src, crate::cache::DEFAULT_CHUNK_SIZE)?;
    Ok(crate::archive::encode_routing(&r))
}

#[cfg(test)]
mod tests {
    use super::{ConvertOptions, Patterns};

    fn wildcard_match(pattern: &str, name: &str) -> bool {
        Patterns::new(&[pattern.into()]).unwrap().is_match(name)
    }

    #[test]
    fn wildcards() {
        assert!(wildcard_match(
            "model.embed_tokens.weight",
            "model.embed_tokens.weight"
        ));
        assert!(wildcard_match(
            "*.mlp.*",
            "model.layers.3.mlp.up_proj.weight"
        ));
        assert!(wildcard_match("*", ""));
        assert!(!wildcard_match(
            "*.bias",
            "model.layers.3.mlp.up_proj.weight"
        ));
        assert!(wildcard_match(
            "model.layers.1*.weight",
            "model.layers.12.mlp.up_proj.weight"
        ));
        assert!(!wildcard_match("model.layers.1*", "model.layers.2.x"));
        // `*` crosses `/` (globset's default), as the hand-written matcher did.
        assert!(wildcard_match("a*b", "a/x/b"));
        let p = Patterns::new(&["*.mlp.*".into(), "lm_head.weight".into()]).unwrap();
        assert!(p.is_match("lm_head.weight") && p.is_match("model.layers.0.mlp.x"));
        assert!(!p.is_match("model.norm.weight"));
    }

    #[test]
    fn invalid_pattern_is_one_line_naming_it() {
        let opts = ConvertOptions {
            passthrough: vec!["model.layers.[0".into()],
            ..ConvertOptions::default()
        };
        let e = opts.validate().unwrap_err().to_string();
        assert!(
            e.contains("\"model.layers.[0\"") && !e.contains('\n'),
            "{e}"
        );
    }
}
