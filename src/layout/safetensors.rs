//! `model.safetensors` layout: the header the `safetensors` writer produces (tensors
//! sorted by dtype alignment descending then name, `{"format":"pt"}` metadata, JSON
//! padded with spaces to a multiple of 8) followed by contiguous tensor data. The JSON
//! is serialized by the `safetensors` crate's own `Metadata`, so it matches byte for byte.

use std::collections::HashMap;

use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::Dtype;

use super::{Builder, LayoutError, VirtualFile};
use crate::model::names;
use crate::model::{FloatType, ModelDesc, PlainType, SourceType, TensorDesc};

/// What one tensor is served as: a float type (converted from whatever the archive
/// holds), or a plain type's stored bytes.
#[derive(Clone, Copy, Debug)]
enum Served {
    Float(FloatType),
    Plain(PlainType),
}

fn st_dtype(t: Served) -> Dtype {
    match t {
        Served::Float(FloatType::F32) => Dtype::F32,
        Served::Float(FloatType::F16) => Dtype::F16,
        Served::Float(FloatType::BF16) => Dtype::BF16,
        Served::Plain(p) => p.safetensors(),
    }
}

/// `dtype` (None: the source's own float type) for float tensors; a plain tensor's
/// own type always (`--dtype` converts weights, never `position_ids`).
fn served(source: SourceType, dtype: Option<FloatType>) -> Served {
    match source {
        SourceType::Plain(p) => Served::Plain(p),
        float => Served::Float(dtype.or(float.float_view()).unwrap_or(FloatType::F32)),
    }
}

impl Served {
    fn size(self) -> u64 {
        match self {
            Served::Float(f) => f.size() as u64,
            Served::Plain(p) => p.size(),
        }
    }
}

/// Hugging Face's default largest shard ("5GB", decimal), the default of
/// `--safetensors-shard-size`.
pub const DEFAULT_SHARD_BYTES: u64 = 5_000_000_000;

/// The name of shard `i` (from 0) of `n`, as `save_pretrained` names them.
fn shard_name(i: usize, n: usize) -> String {
    format!("model-{:05}-of-{n:05}.safetensors", i + 1)
}

/// The tensor bytes of each tensor in the view, in model order, checking shapes.
fn tensor_sizes(model: &ModelDesc, dtype: Option<FloatType>) -> Result<Vec<u64>, LayoutError> {
    model
        .tensors
        .iter()
        .map(|t| {
            let numel = t.shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
            if numel != Some(t.rows() * t.cols()) {
                return Err(LayoutError::Metadata(format!(
                    "tensor {}: shape {:?} inconsistent",
                    t.name, t.shape
                )));
            }
            numel
                .and_then(|n| n.checked_mul(served(t.source, dtype).size()))
                .ok_or_else(|| LayoutError::Metadata(format!("tensor {}: too large", t.name)))
        })
        .collect()
}

/// The safetensors view: `model.safetensors`, or, when its tensors take more than
/// `max_shard` bytes, shards of at most that many tensor bytes (a larger tensor alone
/// in its shard) and their index, split in model order as `save_pretrained` splits a
/// state dict.
pub(super) fn build_view(
    model: &ModelDesc,
    dtype: Option<FloatType>,
    max_shard: u64,
) -> Result<(Vec<VirtualFile>, Option<Vec<u8>>), LayoutError> {
    let mut seen = std::collections::HashSet::new();
    if let Some(t) = model.tensors.iter().find(|t| !seen.insert(t.name.as_str())) {
        return Err(LayoutError::Metadata(format!(
            "tensor {} appears twice",
            t.name
        )));
    }
    let sizes = tensor_sizes(model, dtype)?;
    let total = sizes
        .iter()
        .try_fold(0u64, |a, &n| a.checked_add(n))
        .ok_or_else(|| LayoutError::Metadata("safetensors data size overflows".into()))?;
    if total <= max_shard {
        let all: Vec<usize> = (0..model.tensors.len()).collect();
        return Ok((
            vec![build_file(model, &all, dtype, "model.safetensors")?],
            None,
        ));
    }
    let mut shards: Vec<Vec<usize>> = vec![Vec::new()];
    let mut size = 0u64;
    for (i, &n) in sizes.iter().enumerate() {
        let cur = shards.last_mut().expect("one shard at least");
        if !cur.is_empty() && size + n > max_shard {
            shards.push(Vec::new());
            size = 0;
        }
        shards.last_mut().expect("one shard at least").push(i);
        size += n;
    }
    let n = shards.len();
    let mut files = Vec::with_capacity(n);
    let mut weight_map = std::collections::BTreeMap::new();
    for (k, members) in shards.iter().enumerate() {
        let name = shard_name(k, n);
        for &i in members {
            weight_map.insert(model.tensors[i].name.clone(), name.clone());
        }
        files.push(build_file(model, members, dtype, &name)?);
    }
    // As transformers writes it: keys sorted, two-space indent, a final newline.
    let index = serde_json::json!({
        "metadata": { "total_size": total },
        "weight_map": weight_map,
    });
    let mut bytes = serde_json::to_vec_pretty(&index)
        .map_err(|e| LayoutError::Metadata(format!("safetensors index: {e}")))?;
    bytes.push(b'\n');
    Ok((files, Some(bytes)))
}

/// What the safetensors view undoes of llama.cpp's conventions in a GGUF source's
/// values (nothing for any other source).
struct FromGguf<'a> {
    /// The GGUF architecture, when the source was a GGUF file.
    arch: Option<&'a str>,
}

fn from_gguf(model: &ModelDesc) -> FromGguf<'_> {
    FromGguf {
        arch: model
            .arch
            .gguf_arch
            .as_deref()
            .filter(|_| !model.gguf_meta.is_empty()),
    }
}

impl FromGguf<'_> {
    /// Held transposed (GPT-2's `Conv1D` matrices): served `[in, out]`.
    fn transposed(&self, t: &TensorDesc) -> bool {
        self.arch
            .is_some_and(|a| t.shape.len() == 2 && names::transposed(a, &t.name))
    }
    /// Held with this added (Gemma's `1 + w` norms).
    fn shift(&self, t: &TensorDesc) -> f32 {
        self.arch.map_or(0.0, |a| names::value_shift(a, &t.name))
    }
}

/// One safetensors file `name` of the tensors `members` (indices into the model).
fn build_file(
    model: &ModelDesc,
    members: &[usize],
    dtype: Option<FloatType>,
    name: &str,
) -> Result<VirtualFile, LayoutError> {
    let mut order: Vec<(usize, Served)> = members
        .iter()
        .map(|&i| (i, served(model.tensors[i].source, dtype)))
        .collect();
    // The writer's order: descending dtype alignment, then name.
    order.sort_by(|(a, da), (b, db)| {
        st_dtype(*db)
            .cmp(&st_dtype(*da))
            .then_with(|| model.tensors[*a].name.cmp(&model.tensors[*b].name))
    });

    let mut infos = Vec::with_capacity(order.len());
    let mut offset: u64 = 0;
    for &(i, ft) in &order {
        let t = &model.tensors[i];
        // tensor_sizes checked the shape and that this does not overflow.
        let n = t.numel() * ft.size();
        let end = offset
            .checked_add(n)
            .ok_or_else(|| LayoutError::Metadata("safetensors data size overflows".into()))?;
        let to_usize = |v: u64| {
            usize::try_from(v).map_err(|_| {
                LayoutError::Metadata(format!("tensor {}: size does not fit usize", t.name))
            })
        };
        let mut shape = t
            .shape
            .iter()
            .map(|&d| to_usize(d))
            .collect::<Result<Vec<_>, _>>()?;
        if from_gguf(model).transposed(t) {
            shape.reverse();
        }
        infos.push((
            t.name.clone(),
            TensorInfo {
                dtype: st_dtype(ft),
                shape,
                data_offsets: (to_usize(offset)?, to_usize(end)?),
            },
        ));
        offset = end;
    }
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    let metadata = Metadata::new(Some(meta), infos)
        .map_err(|e| LayoutError::Metadata(format!("safetensors header: {e}")))?;
    let mut json = serde_json::to_string(&metadata)
        .map_err(|e| LayoutError::Metadata(format!("safetensors header: {e}")))?
        .into_bytes();
    json.resize(json.len().next_multiple_of(8), b' ');

    let mut header = Vec::with_capacity(8 + json.len());
    header.extend_from_slice(&(json.len() as u64).to_le_bytes());
    header.extend_from_slice(&json);

    let mut b = Builder::default();
    b.bytes(header)?;
    let undo = from_gguf(model);
    for &(i, ft) in &order {
        let t = &model.tensors[i];
        match ft {
            Served::Float(f) if undo.transposed(t) => {
                b.tensor_transposed(&t.name, i, (t.cols(), t.rows()), f.ggml())?
            }
            Served::Float(f) if undo.shift(t) != 0.0 => {
                b.tensor_plus(&t.name, i, (t.rows(), t.cols()), f.ggml(), -undo.shift(t))?
            }
            Served::Float(f) => {
                b.tensor(&t.name, i, t.rows(), t.cols(), (f.ggml(), false), None)?
            }
            Served::Plain(p) => b.plain_tensor(&t.name, i, (t.rows(), t.cols()), p)?,
        };
    }
    Ok(b.finish(name))
}
