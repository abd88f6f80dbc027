//! Which ggml type `model.gguf` serves each tensor in (`--gguf-type`), decided once
//! when the layout is built. The rules are written down in docs/MOUNT.md ("Views").

use std::fmt;

use super::preset::{
    allows_quantization, fallback, preset_types, Preset, PresetModel, PresetTensor, ALWAYS_F32,
};
use super::LayoutError;
use crate::archive::Store;
use crate::codec::SqParams;
use crate::gguf::quantize::can_quantize;
use crate::gguf::GgmlType;
use crate::model::{ModelDesc, SourceType};

/// What `model.gguf` serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgufView {
    /// Per tensor, the smallest type that adds no noticeable error to what the archive
    /// holds: the source's own blocks where it holds them bit-exact.
    Auto,
    /// Per tensor, the source's own type and bytes where the archive holds them
    /// bit-exact; the other tensors as F16 (BF16 for a BF16 source).
    Source,
    /// Every quantizable tensor in one type, as `llama-quantize --pure` would, falling
    /// back per tensor where a row is not a whole number of the type's blocks.
    Type(GgmlType),
    /// `llama-quantize`'s per-tensor mix for a file type (`q4_k_m` ...).
    Preset(Preset),
}

/// `--gguf-type` spellings of the single types, in the order `--help` lists them.
const TYPES: [(&str, GgmlType); 14] = [
    ("f32", GgmlType::F32),
    ("f16", GgmlType::F16),
    ("bf16", GgmlType::BF16),
    ("q8_0", GgmlType::Q8_0),
    ("q6_k", GgmlType::Q6_K),
    ("q5_k", GgmlType::Q5_K),
    ("q5_1", GgmlType::Q5_1),
    ("q5_0", GgmlType::Q5_0),
    ("q4_k", GgmlType::Q4_K),
    ("q4_1", GgmlType::Q4_1),
    ("q4_0", GgmlType::Q4_0),
    ("iq4_xs", GgmlType::IQ4_XS),
    ("iq4_nl", GgmlType::IQ4_NL),
    ("q3_k", GgmlType::Q3_K),
];

impl GgufView {
    /// Every accepted `--gguf-type` value.
    pub fn names() -> Vec<String> {
        let mut v: Vec<String> = vec!["auto".into(), "source".into()];
        v.extend(
            TYPES
                .iter()
                .filter(|(_, t)| can_serve(*t))
                .map(|(n, _)| n.to_string()),
        );
        // The mixes (q4_k_m ...), and a preset named like a type (q2_k) once.
        for p in offered_presets() {
            let n = p.name().to_ascii_lowercase();
            if !v.contains(&n) {
                v.push(n);
            }
        }
        v
    }

    /// Parse a `--gguf-type` value; the error lists the valid ones.
    pub fn parse(s: &str) -> Result<GgufView, String> {
        let l = s.to_ascii_lowercase();
        match l.as_str() {
            "auto" => return Ok(GgufView::Auto),
            "source" => return Ok(GgufView::Source),
            _ => {}
        }
        if let Some((_, t)) = TYPES.iter().find(|(n, t)| *n == l && can_serve(*t)) {
            return Ok(GgufView::Type(*t));
        }
        if let Some(p) = offered_presets().find(|p| p.name().eq_ignore_ascii_case(s)) {
            return Ok(GgufView::Preset(p));
        }
        Err(format!(
            "unknown GGUF type {s:?}; valid: {}",
            GgufView::names().join(", ")
        ))
    }
}

impl fmt::Display for GgufView {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GgufView::Auto => f.write_str("auto"),
            GgufView::Source => f.write_str("source"),
            GgufView::Type(t) => f.write_str(type_name(*t)),
            GgufView::Preset(p) => f.write_str(&p.name().to_ascii_lowercase()),
        }
    }
}

/// ggml's lower-case name of a type ("q4_k").
pub fn type_name(t: GgmlType) -> &'static str {
    use GgmlType::*;
    match t {
        F32 => "f32",
        F16 => "f16",
        BF16 => "bf16",
        Q4_0 => "q4_0",
        Q4_1 => "q4_1",
        Q5_0 => "q5_0",
        Q5_1 => "q5_1",
        Q8_0 => "q8_0",
        Q8_1 => "q8_1",
        Q2_K => "q2_k",
        Q3_K => "q3_k",
        Q4_K => "q4_k",
        Q5_K => "q5_k",
        Q6_K => "q6_k",
        Q8_K => "q8_k",
        IQ4_NL => "iq4_nl",
        IQ4_XS => "iq4_xs",
        IQ3_XXS => "iq3_xxs",
        IQ3_S => "iq3_s",
        IQ2_S => "iq2_s",
        IQ2_XXS => "iq2_xxs",
        IQ2_XS => "iq2_xs",
        IQ1_S => "iq1_s",
        IQ1_M => "iq1_m",
    }
}

/// Whether a view can produce this type from f32 rows.
fn can_serve(t: GgmlType) -> bool {
    can_quantize(t)
}

/// Presets whose every possible type a view can produce (not the float ones: `f16`
/// and friends name the same views as single types).
fn offered_presets() -> impl Iterator<Item = Preset> {
    let mixed = [
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
    ];
    Preset::ALL.iter().copied().filter(move |p| {
        let low_k = matches!(p.default_type(), GgmlType::Q2_K | GgmlType::Q3_K);
        !matches!(p, Preset::F32 | Preset::F16 | Preset::BF16)
            && mixed.iter().all(|t| can_serve(*t))
            && (!low_k || (can_serve(GgmlType::Q2_K) && can_serve(GgmlType::Q3_K)))
    })
}

/// What the archive holds for one tensor, as far as choosing its view is concerned.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Held {
    /// The source's own bytes, bit-exact (readable with `RowSource::read_raw_rows`).
    Exact(SourceType),
    /// A lossy reconstruction with relative error ‖W−Ŵ‖/‖W‖ measured at conversion
    /// (None: not recorded).
    Lossy(Option<f64>),
    /// A lossy reconstruction whose values lie on an affine grid per group of a row
    /// (NDSQ's scalar R alone; see `TensorSummary::grid`), with its relative error.
    Grid(SqParams, Option<f64>),
}

/// What `store` holds for each of its tensors.
pub fn held_of(store: &dyn Store) -> Vec<Held> {
    (0..store.model().tensors.len())
        .map(|i| match store.raw_format(i) {
            Some(f) => Held::Exact(f),
            None => {
                let s = store.tensor_summary(i);
                match s.grid {
                    Some(g) => Held::Grid(g, s.rel_err),
                    None => Held::Lossy(s.rel_err),
                }
            }
        })
        .collect()
}

/// One tensor of the GGUF view.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorView {
    /// Index into the model's tensors (the first expert of a stack).
    pub index: usize,
    /// Every model tensor this GGUF tensor is made of, in order: `[index]`, or a
    /// layer's experts stacked (`blk.N.ffn_*_exps`).
    pub parts: Vec<usize>,
    pub gguf_name: String,
    /// The type served.
    pub ty: GgmlType,
    /// Served from the archive's stored source bytes as they are.
    pub raw: bool,
    /// The type the view asked for when this tensor could not hold it.
    pub wanted: Option<GgmlType>,
}

/// Relative error ‖Q(W)−W‖/‖W‖ the main type of each llama-quantize mix auto draws
/// from adds to real weights (measured on the test model's reconstructed weights:
/// docs/MOUNT.md, "Views", gives the command), smallest mix first.
const AUTO_MIXES: [(Preset, f64); 4] = [
    (Preset::Q4_K_M, 0.0689),
    (Preset::Q5_K_M, 0.0368),
    (Preset::Q6_K, 0.0183),
    (Preset::Q8_0, 0.0052),
];

/// Auto takes a mix when its main type's error is at most this fraction of the
/// archive's: independent errors add in quadrature, so the weights' error grows by at
/// most 12 %.
const AUTO_ERR_FRACTION: f64 = 0.5;

/// Which of [`AUTO_MIXES`] (index) a lossy tensor with error `err` is served from;
/// None: F16 (the archive is more precise than Q8_0 itself).
fn auto_mix(err: Option<f64>) -> Option<usize> {
    let q8 = AUTO_MIXES.len() - 1;
    match err {
        Some(e) => AUTO_MIXES
            .iter()
            .position(|(_, q)| *q <= AUTO_ERR_FRACTION * e)
            // Q8_0 is the floor for an archive already less precise than Q8_0 (int8
            // rows, 1 % deltas): F16 would double llama.cpp's memory to keep an error
            // below the archive's own.
            .or((e >= AUTO_MIXES[q8].1).then_some(q8)),
        // Unknown loss: Q8_0 adds a tenth of what any lossy codec here loses.
        None => Some(q8),
    }
}

/// The auto view's type for a 2-D tensor held as `held`, and whether it is served raw;
/// `mixes[k]` is the type mix `k` of [`AUTO_MIXES`] gives this tensor (llama-quantize's
/// per-tensor choice, fallbacks included).
/// What the archive holds for a stack of experts, from what it holds for each: the
/// same when they agree (their stored blocks can then be copied, or their grid found
/// again), else lossy at the larger error.
fn stacked(a: Held, b: Held) -> Held {
    let err = |h: Held| match h {
        Held::Exact(_) => Some(0.0),
        Held::Lossy(e) | Held::Grid(_, e) => e,
    };
    match (a, b) {
        _ if a == b => a,
        (Held::Grid(ga, ea), Held::Grid(gb, eb)) if ga == gb => {
            Held::Grid(ga, ea.zip(eb).map(|(x, y)| x.max(y)))
        }
        _ => Held::Lossy(err(a).zip(err(b)).map(|(x, y)| x.max(y))),
    }
}

fn auto_type(held: Held, mixes: &[GgmlType]) -> (GgmlType, bool) {
    match held {
        Held::Exact(SourceType::Ggml(t)) => (t, true),
        Held::Exact(SourceType::BF16) => (GgmlType::BF16, false),
        Held::Exact(_) => (GgmlType::F16, false),
        Held::Grid(g, _) if g.group % 32 == 0 => (grid_type(g), false),
        Held::Lossy(err) | Held::Grid(_, err) => match auto_mix(err) {
            Some(k) => (mixes[k], false),
            None => (GgmlType::F16, false),
        },
    }
}

/// The ggml type for a scalar grid over groups of a multiple of 32 values. Q4_1 and
/// Q5_1 are 4- and 5-bit grids over 32 values: they re-find such a grid exactly in
/// every block whose values span all its levels. A grid over longer groups does not
/// line up with their blocks (re-quantizing the test model's 5-bit/192 embedding as
/// Q5_1 took its KL-divergence from 0.049 to 0.065), so it gets Q8_0, whose 255 levels
/// add well under its own error; so do 6 to 8 bits. A 2- or 3-bit grid gets Q4_1
/// (steps of about half its own): Q8_0 would undo what choosing so few bits saved.
fn grid_type(g: SqParams) -> GgmlType {
    match (g.bits, g.group) {
        (0..=3, _) | (4, 32) => GgmlType::Q4_1,
        (5, 32) => GgmlType::Q5_1,
        _ => GgmlType::Q8_0,
    }
}

/// Bits per weight of a type.
pub fn bits(t: GgmlType) -> f64 {
    let (e, b) = t.block();
    b as f64 * 8.0 / e as f64
}

/// What `model.gguf` serves: the view and, in llama.cpp's order, every tensor that has
/// a GGUF name.
#[derive(Clone, Debug, PartialEq)]
pub struct GgufPlan {
    pub view: GgufView,
    pub tensors: Vec<TensorView>,
}

/// The plan of `view` for `model`, whose tensors the archive holds as `held` (missing
/// entries count as lossy with unknown error).
pub fn plan(model: &ModelDesc, view: GgufView, held: &[Held]) -> Result<GgufPlan, LayoutError> {
    let arch = super::gguf_arch(model)?;
    let order = super::gguf::gguf_order(model)?;
    let ne: Vec<Vec<u64>> = order
        .iter()
        .map(|(parts, name)| super::gguf::served_ne_of(model, parts, name))
        .collect();
    let n_expert = order
        .iter()
        .filter(|(_, name)| super::gguf::is_stack(name))
        .map(|(parts, _)| parts.len() as u32)
        .max()
        .unwrap_or(0);
    let m = PresetModel {
        arch,
        n_layers: model.arch.n_layers,
        n_head: model.arch.n_heads,
        n_head_kv: model.arch.n_kv_heads,
        n_expert,
    };
    let ts: Vec<PresetTensor<'_>> = order
        .iter()
        .zip(&ne)
        .map(|((_, name), ne)| PresetTensor { name, ne })
        .collect();
    let preset = match view {
        GgufView::Preset(p) => Some(preset_types(p, &m, &ts)?),
        _ => None,
    };
    // Auto: each mix's per-tensor choice, [tensor][mix].
    let mixes: Vec<Vec<GgmlType>> = match view {
        GgufView::Auto => {
            let per_mix = AUTO_MIXES
                .iter()
                .map(|(p, _)| preset_types(*p, &m, &ts))
                .collect::<Result<Vec<_>, _>>()?;
            (0..ts.len())
                .map(|k| per_mix.iter().map(|v| v[k].0).collect())
                .collect()
        }
        _ => Vec::new(),
    };
    let tensors = order
        .into_iter()
        .zip(&ne)
        .enumerate()
        .map(|(k, ((parts, gguf_name), ne))| {
            let index = parts[0];
            let t = &model.tensors[index];
            let cols = ne.first().copied().unwrap_or(1);
            let held_of = |i: usize| held.get(i).copied().unwrap_or(Held::Lossy(None));
            let mut h = parts[1..]
                .iter()
                .fold(held_of(index), |a, &i| stacked(a, held_of(i)));
            if super::gguf::is_transposed(model, index) {
                // Served from values: a grid along stored rows runs down the served
                // columns, and stored blocks cannot be copied across.
                h = match h {
                    Held::Grid(_, e) => Held::Lossy(e),
                    Held::Exact(SourceType::Ggml(_)) => Held::Lossy(None),
                    h => h,
                };
            }
            // llama.cpp's converter writes these in F32 whatever the file type: ggml's
            // CPU backend cannot add an F16 position or token-type row to F32 values.
            // So are MoE routers (and Qwen2-MoE's shared-expert gate): small, and what
            // picks the experts.
            let one_d = t.shape.len() < 2
                || ALWAYS_F32.contains(&gguf_name.as_str())
                || gguf_name.ends_with(".ffn_gate_inp.weight")
                || gguf_name.ends_with(".ffn_gate_inp_shexp.weight");
            let quantizable = allows_quantization(
                arch,
                &PresetTensor {
                    name: &gguf_name,
                    ne,
                },
            );
            let (want, raw) = match view {
                // llama.cpp expects F32 norms and biases.
                _ if one_d => (GgmlType::F32, false),
                GgufView::Auto => {
                    // Auto's choices are its own: no fallback notes.
                    let (ty, raw) = auto_type(h, &mixes[k]);
                    return TensorView {
                        index,
                        parts,
                        gguf_name,
                        ty,
                        raw,
                        wanted: None,
                    };
                }
                GgufView::Source => match h {
                    Held::Exact(SourceType::Ggml(q)) => (q, true),
                    Held::Exact(SourceType::F32) => (GgmlType::F32, false),
                    Held::Exact(SourceType::BF16) => (GgmlType::BF16, false),
                    _ if t.source == SourceType::BF16 => (GgmlType::BF16, false),
                    _ => (GgmlType::F16, false),
                },
                GgufView::Preset(_) => {
                    let (ty, wanted) = preset.as_ref().map_or((GgmlType::F32, None), |p| p[k]);
                    return TensorView {
                        index,
                        parts,
                        gguf_name,
                        ty,
                        raw: false,
                        wanted,
                    };
                }
                // llama-quantize copies these in their input's type; a float view still
                // converts them.
                GgufView::Type(ty) if !quantizable => match ty {
                    GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => (ty, false),
                    _ => (GgmlType::F32, false),
                },
                GgufView::Type(ty) => (ty, false),
            };
            let ty = if raw { want } else { fallback(want, cols) };
            TensorView {
                index,
                parts,
                gguf_name,
                ty,
                raw,
                wanted: (ty != want).then_some(want),
            }
        })
        .collect();
    Ok(GgufPlan { view, tensors })
}

/// `general.file_type` (llama.cpp's `llama_ftype`) of a view: the type most of the
/// weights are served in.
pub fn file_type(plan: &GgufPlan, model: &ModelDesc) -> u32 {
    if let GgufView::Preset(p) = plan.view {
        return p.ftype();
    }
    let mut count: Vec<(GgmlType, u64)> = Vec::new();
    for tv in &plan.tensors {
        let n = tv.parts.iter().map(|&i| model.tensors[i].numel()).sum();
        if model.tensors[tv.index].shape.len() < 2 {
            continue;
        }
        match count.iter_mut().find(|(t, _)| *t == tv.ty) {
            Some((_, c)) => *c += n,
            None => count.push((tv.ty, n)),
        }
    }
    let main = count
        .iter()
        .max_by_key(|(_, c)| *c)
        .map_or(GgmlType::F16, |(t, _)| *t);
    ftype_of(main)
}

/// The `llama_ftype` whose main type is `t` (the small K mixes for the K types, which
/// is what `llama-quantize --pure` writes).
fn ftype_of(t: GgmlType) -> u32 {
    use GgmlType::*;
    match t {
        F32 => 0,
        F16 => 1,
        Q4_0 => 2,
        Q4_1 => 3,
        Q8_0 => 7,
        Q5_0 => 8,
        Q5_1 => 9,
        Q2_K => 10,
        Q3_K => 12,
        Q4_K => 14,
        Q5_K => 16,
        Q6_K => 18,
        IQ4_NL => 25,
        IQ4_XS => 30,
        IQ3_XXS => 23,
        IQ3_S => 26,
        IQ2_S => 28,
        IQ2_XXS => 19,
        IQ2_XS => 20,
        IQ1_S => 24,
        IQ1_M => 31,
        BF16 => 32,
        Q8_1 | Q8_K => 1,
    }
}

/// One line for each thing a user of `view` should know about `plan`: every tensor
/// that fell back to another type, and a `source` view with no stored blocks to serve.
pub fn notes(model: &ModelDesc, plan: &GgufPlan) -> Vec<String> {
    let view = plan.view;
    let plan = &plan.tensors;
    let mut v: Vec<String> = plan
        .iter()
        .filter_map(|tv| {
            let want = tv.wanted?;
            Some(format!(
                "model.gguf ({view}): {} has rows of {} values, not a whole number of {} blocks; served as {}",
                tv.gguf_name,
                super::gguf::served_ne(model, tv.index).first().copied().unwrap_or(1),
                type_name(want),
                type_name(tv.ty)
            ))
        })
        .collect();
    let two_d = |tv: &&TensorView| model.tensors[tv.index].shape.len() >= 2;
    if view == GgufView::Source && !plan.iter().filter(two_d).any(|tv| tv.raw) {
        v.push(
            "model.gguf (source): the archive holds no ggml blocks of its source; serving floats"
                .into(),
        );
    }
    v
}

/// Summary of a plan: (type, raw, tensors, weights) per served type, largest first.
pub fn summary(model: &ModelDesc, plan: &GgufPlan) -> Vec<(GgmlType, bool, usize, u64)> {
    let mut v: Vec<(GgmlType, bool, usize, u64)> = Vec::new();
    for tv in &plan.tensors {
        let n = tv.parts.iter().map(|&i| model.tensors[i].numel()).sum();
        match v.iter_mut().find(|e| e.0 == tv.ty && e.1 == tv.raw) {
            Some(e) => {
                e.2 += 1;
                e.3 += n;
            }
            None => v.push((tv.ty, tv.raw, 1, n)),
        }
    }
    v.sort_by_key(|e| std::cmp::Reverse(e.3));
    v
}
