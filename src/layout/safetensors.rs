//! `model.safetensors` layout: the header the `safetensors` writer produces (tensors
//! sorted by dtype alignment descending then name, `{"format":"pt"}` metadata, JSON
//! padded with spaces to a multiple of 8) followed by contiguous tensor data. The JSON
//! is serialized by the `safetensors` crate's own `Metadata`, so it matches byte for byte.

use std::collections::HashMap;

use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::Dtype;

use super::{tensor_bytes, Builder, LayoutError, VirtualFile};
use crate::model::{FloatType, ModelDesc};

fn st_dtype(t: FloatType) -> Dtype {
    match t {
        FloatType::F32 => Dtype::F32,
        FloatType::F16 => Dtype::F16,
        FloatType::BF16 => Dtype::BF16,
    }
}

pub(super) fn build(
    model: &ModelDesc,
    dtype: Option<FloatType>,
) -> Result<VirtualFile, LayoutError> {
    let mut order: Vec<(usize, FloatType)> = model
        .tensors
        .iter()
        .enumerate()
        .map(|(i, t)| (i, dtype.unwrap_or_else(|| t.source.default_float())))
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
        let (_, n) = tensor_bytes(&t.name, t.rows(), t.cols(), ft.ggml())?;
        let numel = t.shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
        if numel != Some(t.rows() * t.cols()) {
            return Err(LayoutError::Metadata(format!(
                "tensor {}: shape {:?} inconsistent",
                t.name, t.shape
            )));
        }
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
        b.tensor(&t.name, i, t.rows(), t.cols(), (ft.ggml(), false), None)?;
    }
    Ok(b.finish("model.safetensors"))
}
