//! Calibration statistics cawsfs gathers itself (docs/CODECS.md, "Error feedback"): a
//! CPU forward pass of the source model over a calibration text, one layer at a time,
//! giving each linear layer's input second moment H = Σ x xᵀ / n. The same statistics
//! `scripts/calibrate.py` computes with transformers, without Python and without
//! holding more than one layer's matrices: [`Forward::layer`] returns layer `l`'s and
//! moves the residual stream past it.
//!
//! The llama family only (llama, qwen2 with its q/k/v biases, qwen3 with its per-head
//! q/k norms): the architecture of the float test model and of most dense models people
//! convert. Any other model is converted without feedback and the report says why
//! ([`Forward::new`] gives the reason). Llama 3's long-context rope scaling is not
//! applied: it changes positions beyond the 512-token windows used here very little.
//!
//! Deterministic: every product is cut into fixed pieces, each computed by one thread
//! (`Par::Seq`), so the statistics, and so the archive, do not depend on the thread count.

use std::collections::HashMap;
use std::sync::Arc;

use rayon::prelude::*;

use super::ConvertError;
use ops::{add, attention, gram, linear, rms_norm, rope};

mod ops;
pub mod probe;
use crate::error::FileError;
use crate::import::SourceModel;
use crate::model::names::layer_of;

/// The text used when none is named: three licence texts (prose) and Rust source (code).
pub const BUNDLED_TEXT: &str = include_str!("../../../assets/calibration.txt");
/// Tokens per window: attention runs within a window, as over a prompt.
pub const CTX: usize = 512;
/// Tokens gathered by default: 8 windows. On the float test model 4 096 tokens give
/// nearly all of the feedback's gain (docs/QUALITY.md); the pass costs about 2 × the
/// model's weights × tokens floating-point operations.
pub const DEFAULT_TOKENS: usize = 4096;
/// Fewest tokens a text must give: fewer make H too poorly conditioned to use.
pub const MIN_TOKENS: usize = 64;

/// The text a conversion gathers its statistics over.
#[derive(Clone, Debug)]
pub struct SelfCalibration {
    /// Named in the report; a file's path when one was given.
    pub label: String,
    /// The file the text came from (errors about the text name it).
    pub path: Option<std::path::PathBuf>,
    pub text: Arc<str>,
    pub max_tokens: usize,
}

impl SelfCalibration {
    pub fn bundled() -> SelfCalibration {
        SelfCalibration {
            label: "bundled text".into(),
            path: None,
            text: BUNDLED_TEXT.into(),
            max_tokens: DEFAULT_TOKENS,
        }
    }

    /// A user's text file, read whole (it is checked to be a regular UTF-8 file).
    pub fn from_file(path: &std::path::Path, max_tokens: usize) -> Result<Self, FileError> {
        let meta = std::fs::metadata(path).map_err(|e| FileError::io(path, e))?;
        if !meta.is_file() {
            return Err(FileError::invalid(path, "not a regular file"));
        }
        // Far more than any useful calibration text; a bound so a wrong path (a model
        // file) is refused instead of read into memory.
        if meta.len() > 64 << 20 {
            return Err(FileError::invalid(
                path,
                "is over 64 MiB: a calibration text is a few thousand tokens of plain text",
            ));
        }
        let bytes = std::fs::read(path).map_err(|e| FileError::io(path, e))?;
        let text = String::from_utf8(bytes)
            .map_err(|e| FileError::invalid(path, format!("is not UTF-8 text ({e})")))?;
        Ok(SelfCalibration {
            label: path.display().to_string(),
            path: Some(path.to_path_buf()),
            text: text.into(),
            max_tokens,
        })
    }

    fn error(&self, why: String) -> ConvertError {
        match &self.path {
            Some(p) => FileError::invalid(p, why).into(),
            None => ConvertError::Options(format!("{}: {why}", self.label)),
        }
    }
}

/// Input second moments of one step's linear layers: weight name → H (cols × cols,
/// row-major). Weights reading the same input share one matrix.
pub type Moments = HashMap<String, Arc<Vec<f32>>>;

#[derive(Clone, Copy, Debug)]
struct Dims {
    d: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    ff: usize,
    eps: f32,
    theta: f32,
    layers: u32,
}

/// The residual stream of every calibration token, between layers.
pub struct Forward<'a> {
    src: &'a dyn SourceModel,
    dims: Dims,
    /// tokens × d, row-major.
    h: Vec<f32>,
    /// Tokens per window (the last window is as long as the others).
    ctx: usize,
    next_layer: u32,
    /// The weights whose inputs' moments are wanted (others are not computed), and
    /// the last layer holding one (the pass stops after it).
    needs: std::collections::HashSet<String>,
    last_needed: Option<u32>,
    /// Tokens the statistics are gathered over.
    pub tokens: usize,
}

const LAYER_PARTS: [&str; 9] = [
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
];

impl<'a> Forward<'a> {
    /// Tokenize the text and look up its embeddings, to gather the moments of the
    /// inputs of the weights `needs` names (`None`: all). `Ok(Err(why))` when the
    /// model is not one this pass runs (its architecture, names or shapes); `Err` when
    /// the text cannot serve (too short) or the source cannot be read.
    pub fn new(
        src: &'a dyn SourceModel,
        cal: &SelfCalibration,
        needs: Option<std::collections::HashSet<String>>,
    ) -> Result<Result<Forward<'a>, String>, ConvertError> {
        let dims = match dims_of(src) {
            Ok(d) => d,
            Err(why) => return Ok(Err(why)),
        };
        let (picked, ctx, e) = match pick_tokens(src, cal, CTX, cal.max_tokens)? {
            Ok(p) => p,
            Err(why) => return Ok(Err(why)),
        };
        let emb = src.f32(e)?;
        let d = dims.d;
        let mut h = vec![0f32; picked.len() * d];
        for (row, &id) in h.chunks_exact_mut(d).zip(&picked) {
            row.copy_from_slice(&emb[id as usize * d..][..d]);
        }
        let needs = needs.unwrap_or_else(|| {
            let mut all: std::collections::HashSet<String> = (0..dims.layers)
                .flat_map(|l| LAYER_PARTS.map(|p| format!("model.layers.{l}.{p}")))
                .collect();
            all.insert("lm_head.weight".into());
            all
        });
        let last_needed = needs
            .iter()
            .map(|n| match layer_of(n) {
                Some(l) => l,
                None => dims.layers,
            })
            .max();
        Ok(Ok(Forward {
            src,
            dims,
            h,
            ctx,
            next_layer: 0,
            needs,
            last_needed,
            tokens: picked.len(),
        }))
    }

    fn weight(&self, name: &str, rows: usize, cols: usize) -> Result<Vec<f32>, ConvertError> {
        weight(self.src, name, rows, cols)
    }
}

/// Tensor `name` as f32, checked to hold `rows × cols` values.
fn weight(
    src: &dyn SourceModel,
    name: &str,
    rows: usize,
    cols: usize,
) -> Result<Vec<f32>, ConvertError> {
    let desc = src.desc();
    let i = desc
        .tensor_index(name)
        .ok_or_else(|| ConvertError::Options(format!("calibration: no tensor {name}")))?;
    let t = &desc.tensors[i];
    if t.numel() != (rows * cols) as u64 {
        return Err(ConvertError::Options(format!(
            "calibration: {name} has shape {:?}, expected [{rows}, {cols}]",
            t.shape
        )));
    }
    Ok(src.f32(i)?)
}

/// Optional bias or norm of `len` values.
fn vector(src: &dyn SourceModel, name: &str, len: usize) -> Result<Option<Vec<f32>>, ConvertError> {
    match src.desc().tensor_index(name) {
        Some(_) => weight(src, name, len, 1).map(Some),
        None => Ok(None),
    }
}

/// Tokens picked, the window length, the embedding's tensor index.
type Picked = (Vec<u32>, usize, usize);

/// Sees each linear layer's input: the roles reading it, its values, its width.
type Keep<'k> = dyn FnMut(&[&str], &[f32], usize) + 'k;

/// The calibration tokens: windows of up to `ctx` tokens spread evenly over the text
/// (prose and code alike), as many as `max_tokens` allows; a shorter text, or fewer
/// tokens asked for than a window holds, is one window. With the window length and the
/// embedding's tensor index; `Ok(Err(why))` when the model has no tokenizer or
/// embedding these tokens can index.
fn pick_tokens(
    src: &dyn SourceModel,
    cal: &SelfCalibration,
    ctx: usize,
    max_tokens: usize,
) -> Result<Result<Picked, String>, ConvertError> {
    let desc = src.desc();
    let tok = match crate::router::load_tokenizer(desc) {
        Ok(t) => t,
        Err(e) => return Ok(Err(e)),
    };
    let enc = tok
        .encode(&*cal.text, true)
        .map_err(|e| cal.error(format!("cannot be tokenized: {e}")))?;
    let ids = enc.get_ids();
    if ids.len() < MIN_TOKENS {
        return Err(cal.error(format!(
            "gives {} tokens; calibration needs at least {MIN_TOKENS}",
            ids.len()
        )));
    }
    let Some(e) = desc.tensor_index("model.embed_tokens.weight") else {
        return Ok(Err("the model has no model.embed_tokens.weight".into()));
    };
    let vocab = desc.tensors[e].rows() as u32;
    if let Some(id) = ids.iter().find(|&&id| id >= vocab) {
        return Ok(Err(format!(
            "its tokenizer gives token {id}, beyond the embedding's {vocab} rows"
        )));
    }
    let ctx = ctx.min(ids.len()).min(max_tokens.max(MIN_TOKENS));
    let have = ids.len() / ctx;
    let want = (max_tokens / ctx).clamp(1, have);
    let mut picked = Vec::with_capacity(want * ctx);
    for w in 0..want {
        let start = (w * have / want) * ctx;
        picked.extend_from_slice(&ids[start..start + ctx]);
    }
    Ok(Ok((picked, ctx, e)))
}

/// One decoder layer's weights as f32, by the role names of [`ROLES`].
struct Layer {
    ln1: Vec<f32>,
    ln2: Vec<f32>,
    /// q, k, v, o, gate, up, down (each as stored: out × in).
    m: [Vec<f32>; 7],
    bias: [Option<Vec<f32>>; 3],
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
}

/// The linear layers of a decoder layer, in [`Layer::m`]'s order.
const ROLES: [&str; 7] = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
];

impl Layer {
    fn load(src: &dyn SourceModel, dims: &Dims, l: u32) -> Result<Layer, ConvertError> {
        let p = |part: &str| format!("model.layers.{l}.{part}");
        let (d, q, kv, ff) = (
            dims.d,
            dims.heads * dims.head_dim,
            dims.kv_heads * dims.head_dim,
            dims.ff,
        );
        let shapes = [(q, d), (kv, d), (kv, d), (d, q), (ff, d), (ff, d), (d, ff)];
        let mut m: [Vec<f32>; 7] = Default::default();
        for ((w, role), (rows, cols)) in m.iter_mut().zip(ROLES).zip(shapes) {
            *w = weight(src, &p(&format!("{role}.weight")), rows, cols)?;
        }
        let mut bias: [Option<Vec<f32>>; 3] = Default::default();
        for (b, (role, rows)) in bias.iter_mut().zip(ROLES.iter().zip([q, kv, kv])) {
            *b = vector(src, &p(&format!("{role}.bias")), rows)?;
        }
        Ok(Layer {
            ln1: weight(src, &p("input_layernorm.weight"), d, 1)?,
            ln2: weight(src, &p("post_attention_layernorm.weight"), d, 1)?,
            m,
            bias,
            q_norm: vector(src, &p("self_attn.q_norm.weight"), dims.head_dim)?,
            k_norm: vector(src, &p("self_attn.k_norm.weight"), dims.head_dim)?,
        })
    }

    /// Moves the residual stream `h` (tokens × d, windows of `ctx`) past this layer,
    /// handing `keep` each linear layer's input with the roles that read it.
    /// `over`: a matrix (by its index in [`ROLES`]) used in place of the layer's own.
    fn run(
        &self,
        dims: &Dims,
        h: &mut [f32],
        ctx: usize,
        keep: &mut Keep,
        over: Option<(usize, &[f32])>,
    ) {
        let Dims {
            d,
            heads,
            kv_heads,
            head_dim: hd,
            ff,
            eps,
            theta,
            ..
        } = *dims;
        let n = h.len() / d;
        let m = |i: usize| match over {
            Some((j, w)) if j == i => w,
            _ => &self.m[i][..],
        };
        let [wq, wk, wv, wo, wg, wu, wd] = [0, 1, 2, 3, 4, 5, 6].map(m);
        let x = rms_norm(h, d, &self.ln1, eps);
        keep(&ROLES[..3], &x, d);
        let mut q = linear(&x, n, d, wq, heads * hd, self.bias[0].as_deref());
        let mut k = linear(&x, n, d, wk, kv_heads * hd, self.bias[1].as_deref());
        let v = linear(&x, n, d, wv, kv_heads * hd, self.bias[2].as_deref());
        drop(x);
        // qwen3 normalizes each head's query and key before the rotation.
        if let Some(g) = &self.q_norm {
            q = rms_norm(&q, hd, g, eps);
        }
        if let Some(g) = &self.k_norm {
            k = rms_norm(&k, hd, g, eps);
        }
        rope(&mut q, heads, hd, ctx, theta);
        rope(&mut k, kv_heads, hd, ctx, theta);
        let a = attention(&q, &k, &v, n, ctx, heads, kv_heads, hd);
        drop((q, k, v));
        keep(&ROLES[3..4], &a, heads * hd);
        add(h, &linear(&a, n, heads * hd, wo, d, None));
        drop(a);
        let x = rms_norm(h, d, &self.ln2, eps);
        keep(&ROLES[4..6], &x, d);
        let mut gate = linear(&x, n, d, wg, ff, None);
        let up = linear(&x, n, d, wu, ff, None);
        drop(x);
        gate.par_iter_mut().zip(up.par_iter()).for_each(|(g, u)| {
            *g = *g / (1.0 + (-*g).exp()) * u;
        });
        drop(up);
        keep(&ROLES[6..], &gate, ff);
        add(h, &linear(&gate, n, ff, wd, d, None));
    }
}

impl Forward<'_> {
    /// Layer `l`'s input moments, the residual stream moved past it. Layers are taken
    /// in order: those skipped are run, and one already passed (or beyond the model's
    /// last) has none.
    pub fn layer(&mut self, l: u32) -> Result<Moments, ConvertError> {
        let past_needs = self.last_needed.is_none_or(|last| l > last);
        if l < self.next_layer || l >= self.dims.layers || past_needs {
            return Ok(Moments::new());
        }
        while self.next_layer < l {
            self.step()?;
        }
        self.step()
    }

    /// The next layer's input moments, and the residual stream moved past it.
    fn step(&mut self) -> Result<Moments, ConvertError> {
        let l = self.next_layer;
        let w = Layer::load(self.src, &self.dims, l)?;
        let n = self.tokens;
        let mut out = Moments::new();
        // Moments of an input none of whose readers is wanted are not computed.
        let needs = &self.needs;
        let mut keep = |readers: &[&str], x: &[f32], width: usize| {
            let readers: Vec<String> = readers
                .iter()
                .map(|r| format!("model.layers.{l}.{r}.weight"))
                .collect();
            if readers.iter().any(|r| needs.contains(r)) {
                let hx = Arc::new(gram(x, n, width));
                for r in readers {
                    out.insert(r, hx.clone());
                }
            }
        };
        w.run(&self.dims, &mut self.h, self.ctx, &mut keep, None);
        self.next_layer += 1;
        Ok(out)
    }

    /// The output matrix's input moments (after the last layer and the final norm).
    pub fn head(&mut self) -> Result<Moments, ConvertError> {
        if !self.needs.contains("lm_head.weight") {
            return Ok(Moments::new());
        }
        while self.next_layer < self.dims.layers {
            self.step()?;
        }
        let d = self.dims.d;
        let g = self.weight("model.norm.weight", d, 1)?;
        let x = rms_norm(&self.h, d, &g, self.dims.eps);
        let mut out = Moments::new();
        out.insert("lm_head.weight".into(), Arc::new(gram(&x, self.tokens, d)));
        Ok(out)
    }
}

/// What the calibration pass computes before a group of tensors is encoded.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Step {
    None,
    Layer(u32),
    Head,
}

/// Tensors grouped in the forward pass's order: those of no layer (the embedding,
/// norms) first, then each layer's, then the output matrix, which reads the last.
pub fn pass_order(desc: &crate::model::ModelDesc) -> Vec<(Step, Vec<usize>)> {
    let mut layers: std::collections::BTreeMap<u32, Vec<usize>> = Default::default();
    let (mut first, mut head) = (Vec::new(), Vec::new());
    for (i, t) in desc.tensors.iter().enumerate() {
        match layer_of(&t.name) {
            Some(l) => layers.entry(l).or_default().push(i),
            None if t.name == "lm_head.weight" => head.push(i),
            None => first.push(i),
        }
    }
    let mut out = vec![(Step::None, first)];
    out.extend(layers.into_iter().map(|(l, m)| (Step::Layer(l), m)));
    out.push((Step::Head, head));
    out
}

/// Whether this pass runs `src` (its architecture, names and shapes).
pub fn runs(src: &dyn SourceModel) -> bool {
    dims_of(src).is_ok()
}

/// The model's dimensions when this pass can run it, or why not.
fn dims_of(src: &dyn SourceModel) -> Result<Dims, String> {
    let desc = src.desc();
    let a = &desc.arch;
    if !matches!(
        a.model_type.as_str(),
        "llama" | "qwen2" | "qwen3" | "mistral"
    ) {
        return Err(format!(
            "no built-in forward pass for architecture {}",
            a.model_type
        ));
    }
    let d = a.hidden_size as usize;
    let heads = a.n_heads as usize;
    let kv_heads = a.n_kv_heads as usize;
    if d == 0 || heads == 0 || kv_heads == 0 || heads % kv_heads != 0 || a.n_layers == 0 {
        return Err(format!(
            "hidden size {d}, {heads} heads, {kv_heads} KV heads, {} layers",
            a.n_layers
        ));
    }
    let hd = match a.head_dim {
        0 => d / heads,
        h => h as usize,
    };
    if hd == 0 || hd % 2 != 0 {
        return Err(format!("head dimension {hd} is not even"));
    }
    let shape = |name: &str| {
        desc.tensor_index(name)
            .map(|i| desc.tensors[i].shape.clone())
    };
    let ff = match shape("model.layers.0.mlp.gate_proj.weight") {
        Some(s) if s.len() == 2 => s[0] as usize,
        _ => return Err("layer 0 has no 2-D mlp.gate_proj.weight".into()),
    };
    let expect = |part: &str| -> Vec<u64> {
        let (d, ff, q, kv) = (
            d as u64,
            ff as u64,
            (heads * hd) as u64,
            (kv_heads * hd) as u64,
        );
        match part {
            "self_attn.q_proj.weight" => vec![q, d],
            "self_attn.k_proj.weight" | "self_attn.v_proj.weight" => vec![kv, d],
            "self_attn.o_proj.weight" => vec![d, q],
            "mlp.gate_proj.weight" | "mlp.up_proj.weight" => vec![ff, d],
            "mlp.down_proj.weight" => vec![d, ff],
            _ => vec![d],
        }
    };
    for l in 0..a.n_layers {
        for part in LAYER_PARTS {
            let name = format!("model.layers.{l}.{part}");
            match shape(&name) {
                Some(s) if s == expect(part) => {}
                Some(s) => return Err(format!("{name} has shape {s:?}, not {:?}", expect(part))),
                None => return Err(format!("the model has no {name}")),
            }
        }
    }
    if shape("model.norm.weight") != Some(vec![d as u64]) {
        return Err("the model has no model.norm.weight of its hidden size".into());
    }
    let theta = if a.rope_theta > 0.0 {
        a.rope_theta
    } else {
        10000.0
    };
    let eps = if a.rms_norm_eps > 0.0 {
        a.rms_norm_eps
    } else {
        1e-6
    };
    Ok(Dims {
        d,
        heads,
        kv_heads,
        head_dim: hd,
        ff,
        eps,
        theta,
        layers: a.n_layers,
    })
}

/// Run the pass over every layer and write the statistics as `scripts/calibrate.py`
/// does (the format [`crate::import::calibration`] reads), for `convert --calibration`.
/// Holds every layer's matrices until the file is written: for a model of L layers of
/// width d and FFN width f, about L·(3d² + f²)·4 bytes. Returns the tokens used, or
/// why the model cannot be run.
pub fn write_statistics(
    src: &dyn SourceModel,
    cal: &SelfCalibration,
    out: &std::path::Path,
) -> Result<Result<usize, String>, ConvertError> {
    let mut f = match Forward::new(src, cal, None)? {
        Ok(f) => f,
        Err(why) => return Ok(Err(why)),
    };
    let mut all = Vec::new();
    for l in 0..f.dims.layers {
        all.push(f.layer(l)?);
    }
    all.push(f.head()?);
    // Weights reading one input share one matrix, stored once under the first's name.
    let mut readers = std::collections::BTreeMap::new();
    let mut tensors: Vec<(String, Arc<Vec<f32>>)> = Vec::new();
    for m in &all {
        let mut names: Vec<&String> = m.keys().collect();
        names.sort();
        for name in names {
            let h = &m[name];
            let owner = match tensors.iter().find(|(_, t)| Arc::ptr_eq(t, h)) {
                Some((o, _)) => o.clone(),
                None => {
                    tensors.push((name.clone(), h.clone()));
                    name.clone()
                }
            };
            readers.insert(name.clone(), owner);
        }
    }
    let views = tensors
        .iter()
        .map(|(name, h)| {
            let d = (h.len() as f64).sqrt() as usize;
            let v = safetensors::tensor::TensorView::new(
                safetensors::Dtype::F32,
                vec![d, d],
                bytemuck::cast_slice(h.as_slice()),
            )
            .map_err(|e| ConvertError::Options(format!("{name}: {e}")))?;
            Ok((name.clone(), v))
        })
        .collect::<Result<Vec<_>, ConvertError>>()?;
    let meta = std::collections::HashMap::from([
        (
            "readers".to_string(),
            serde_json::to_string(&readers).expect("names serialize"),
        ),
        ("tokens".to_string(), f.tokens.to_string()),
        ("ctx".to_string(), f.ctx.to_string()),
        ("text".to_string(), cal.label.clone()),
    ]);
    // Written beside the output and renamed: never a partial file under its name.
    let dir = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => std::path::Path::new("."),
    };
    let tmp = tempfile::Builder::new()
        .prefix(".cawsfs-calibration-")
        .tempfile_in(dir)
        .map_err(|e| FileError::io(out, e))?;
    safetensors::serialize_to_file(views, Some(meta), tmp.path())
        .map_err(|e| FileError::invalid(out, format!("writing statistics: {e}")))?;
    tmp.persist(out).map_err(|e| FileError::io(out, e.error))?;
    Ok(Ok(f.tokens))
}
