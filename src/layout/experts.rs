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
            let name = &model.tensors.get(i)?.name;
            let (_, e) = names::hf_expert_to_gguf_in(arch, name)?;
            Some((names::layer_of(name)?, e, a..b))
        })
        .collect();
    (extents, hfmeta::experts_per_token(model))
}
