//! `model.safetensors` layout: the header the `safetensors` writer produces (tensors
//! sorted by dtype alignment descending then name, `{"format":"pt"}` metadata, JSON
//! padded with spaces to a multiple of 8) followed by contiguous tensor data. The JSON
//! is serialized by the `safetensors` crate's own `Metadata`, so it matches byte for byte.

use std::collections::HashMap;

use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::Dtype;

use super::{Builder, LayoutError, VirtualFile};
use crate::model::{FloatType, ModelDesc, PlainType, SourceType};

/// What one tensor is served as: a float type (converted from whatever the archive
/// holds), or a plain type's stored bytes.
#[derive(Clone, Copy, Debug)]
enum Served {
    Float(FloatType),
    Plain(PlainType),
}

fn st_dtype(t: Served) -> Dtype {
    use PlainType as P;
    match t {
        Served::Float(FloatType::F32) => Dtype::F32,
        Served::Float(FloatType::F16) => Dtype::F16,
        Served::Float(FloatType::BF16) => Dtype::BF16,
        Served::Plain(p) => match p {
            P::Bool => Dtype::BOOL,
            P::U8 => Dtype::U8,
            P::I8 => Dtype::I8,
            P::F8E4M3 => Dtype::F8_E4M3,
            P::F8E5M2 => Dtype::F8_E5M2,
            P::I16 => Dtype::I16,
            P::U16 => Dtype::U16,
            P::I32 => Dtype::I32,
            P::U32 => Dtype::U32,
            P::F64 => Dtype::F64,
            P::I64 => Dtype::I64,
            P::U64 => Dtype::U64,
        },
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

pub(super) fn build(
    model: &ModelDesc,
    dtype: Option<FloatType>,
) -> Result<VirtualFile, LayoutError> {
    let mut order: Vec<(usize, Served)> = model
        .tensors
        .iter()
        .enumerate()
        .map(|(i, t)| (i, served(t.source, dtype)))
        .collect();
    // The writer's order: descending dtype alignment, then name.
    order.sort_by(|(a, da), (b, db)| {
        st_dtype(*db)
            .cmp(&st_dtype(*da))
            .then_with(|| model.tensors[*a].name.cmp(&model.tensors[*b].name))
    });

    let mut seen = std::collections::HashSet::new();
    if let Some(t) = model.tensors.iter().find(|t| !seen.insert(t.name.as_str())) {
        return Err(LayoutError::Metadata(format!(
            "tensor {} appears twice",
            t.name
        )));
    }
    let mut infos = Vec::with_capacity(order.len());
    let mut offset: u64 = 0;
    for &(i, ft) in &order {
        let t = &model.tensors[i];
        let numel = t.shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
        if numel != Some(t.rows() * t.cols()) {
            return Err(LayoutError::Metadata(format!(
                "tensor {}: shape {:?} inconsistent",
                t.name, t.shape
            )));
        }
        let n = numel
            .and_then(|n| n.checked_mul(ft.size()))
            .ok_or_else(|| LayoutError::Metadata(format!("tensor {}: too large", t.name)))?;
        let end = offset
            .checked_add(n)
            .ok_or_else(|| LayoutError::Metadata("safetensors data size overflows".into()))?;
        let to_usize = |v: u64| {
            usize::try_from(v).map_err(|_| {
                LayoutError::Metadata(format!("tensor {}: size does not fit usize", t.name))
            })
        };
        let shape = t
            .shape
            .iter()
            .map(|&d| to_usize(d))
            .collect::<Result<Vec<_>, _>>()?;
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
    for &(i, ft) in &order {
        let t = &model.tensors[i];
        match ft {
            Served::Float(f) => {
                b.tensor(&t.name, i, t.rows(), t.cols(), (f.ggml(), false), None)?
            }
            Served::Plain(p) => b.plain_tensor(&t.name, i, (t.rows(), t.cols()), p)?,
        };
    }
    Ok(b.finish("model.safetensors"))
}
