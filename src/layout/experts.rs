//! Where a virtual file's experts lie, for the mount's expert predictor
//! (docs/MOE.md, "One step ahead").

use super::{hfmeta, VirtualFile};
use crate::model::{names, ModelDesc};

/// `(layer, expert, byte range)` of every expert tensor of a file, and how many
/// experts a token uses (None when the source does not say).
pub type ExpertExtents = (Vec<(u32, u32, std::ops::Range<u64>)>, Option<u32>);

/// Where `file`'s experts lie; none for a dense model.
pub fn expert_extents(model: &ModelDesc, file: &VirtualFile) -> ExpertExtents {
    let Some(arch) = model.arch.gguf_arch.as_deref() else {
        return (Vec::new(), None);
    };
    let extents = file
        .tensor_ranges()
        .into_iter()
        .filter_map(|(i, a, b)| {
            let (l, e) = layer_and_expert(arch, &model.tensors.get(i)?.name)?;
            Some((l, e, a..b))
        })
        .collect();
    (extents, hfmeta::experts_per_token(model))
}

/// The layer and expert number of an expert tensor; None for any other tensor.
fn layer_and_expert(arch: &str, name: &str) -> Option<(u32, u32)> {
    let (_, e) = names::hf_expert_to_gguf_in(arch, name)?;
    Some((names::layer_of(name)?, e))
}

/// A mixture of experts as an archive holds it, for `inspect`: every expert tensor
/// as `(tensor index, layer, expert)`, and how many experts a token uses.
pub struct ExpertTensors {
    pub tensors: Vec<(usize, u32, u32)>,
    pub per_token: Option<u32>,
}

impl ExpertTensors {
    /// The experts of `model`; `tensors` is empty for a dense model.
    pub fn of(model: &ModelDesc) -> Self {
        let Some(arch) = model.arch.gguf_arch.as_deref() else {
            return ExpertTensors {
                tensors: Vec::new(),
                per_token: None,
            };
        };
        let tensors = model
            .tensors
            .iter()
            .enumerate()
            .filter_map(|(i, t)| {
                let (l, e) = layer_and_expert(arch, &t.name)?;
                Some((i, l, e))
            })
            .collect();
        ExpertTensors {
            tensors,
            per_token: hfmeta::experts_per_token(model),
        }
    }

    /// `(layer, expert) → sum of bytes(tensor)` over each expert's tensors, sorted.
    pub fn per_expert(&self, bytes: impl Fn(usize) -> u64) -> Vec<((u32, u32), u64)> {
        let mut m = std::collections::BTreeMap::new();
        for &(i, l, e) in &self.tensors {
            *m.entry((l, e)).or_insert(0) += bytes(i);
        }
        m.into_iter().collect()
    }
}
