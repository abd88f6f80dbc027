//! Tensor naming and row order between the Hugging Face and llama.cpp conventions.
//!
//! llama.cpp's converter permutes the rows of Q and K projections of llama-architecture
//! models so its rotary embedding can rotate adjacent pairs: within each head of
//! `hd` rows, HF row `j*hd/2 + i` becomes GGUF row `2*i + j` (j ∈ {0,1}). Qwen2 uses
//! the NEOX rotary layout and is not permuted.

/// The GGUF `general.architecture` of a Hugging Face `model_type` whose tensors this
/// module can name for llama.cpp; None for any other (the mount serves no GGUF view).
pub fn gguf_arch_of(model_type: &str) -> Option<&'static str> {
    match model_type {
        "llama" | "mistral" => Some("llama"),
        "qwen2" => Some("qwen2"),
        "qwen3" => Some("qwen3"),
        _ => None,
    }
}

/// Per-layer suffixes: (Hugging Face, GGUF).
const LAYER_NAMES: &[(&str, &str)] = &[
    ("input_layernorm.weight", "attn_norm.weight"),
    ("post_attention_layernorm.weight", "ffn_norm.weight"),
    ("self_attn.q_proj.weight", "attn_q.weight"),
    ("self_attn.k_proj.weight", "attn_k.weight"),
    ("self_attn.v_proj.weight", "attn_v.weight"),
    ("self_attn.o_proj.weight", "attn_output.weight"),
    ("self_attn.q_proj.bias", "attn_q.bias"),
    ("self_attn.k_proj.bias", "attn_k.bias"),
    ("self_attn.v_proj.bias", "attn_v.bias"),
    // Qwen3's per-head RMS norms of Q and K.
    ("self_attn.q_norm.weight", "attn_q_norm.weight"),
    ("self_attn.k_norm.weight", "attn_k_norm.weight"),
    ("mlp.gate_proj.weight", "ffn_gate.weight"),
    ("mlp.up_proj.weight", "ffn_up.weight"),
    ("mlp.down_proj.weight", "ffn_down.weight"),
];

const GLOBAL_NAMES: &[(&str, &str)] = &[
    ("model.embed_tokens.weight", "token_embd.weight"),
    ("model.norm.weight", "output_norm.weight"),
    ("lm_head.weight", "output.weight"),
];

/// Hugging Face name → llama.cpp name, or None for a tensor llama.cpp has no name for.
pub fn hf_to_gguf(name: &str) -> Option<String> {
    if let Some((_, g)) = GLOBAL_NAMES.iter().find(|(h, _)| *h == name) {
        return Some(g.to_string());
    }
    let rest = name.strip_prefix("model.layers.")?;
    let (layer, suffix) = rest.split_once('.')?;
    let layer: u32 = layer.parse().ok()?;
    let (_, g) = LAYER_NAMES.iter().find(|(h, _)| *h == suffix)?;
    Some(format!("blk.{layer}.{g}"))
}

/// llama.cpp name → Hugging Face name.
pub fn gguf_to_hf(name: &str) -> Option<String> {
    if let Some((h, _)) = GLOBAL_NAMES.iter().find(|(_, g)| *g == name) {
        return Some(h.to_string());
    }
    let rest = name.strip_prefix("blk.")?;
    let (layer, suffix) = rest.split_once('.')?;
    let layer: u32 = layer.parse().ok()?;
    let (h, _) = LAYER_NAMES.iter().find(|(_, g)| *g == suffix)?;
    Some(format!("model.layers.{layer}.{h}"))
}

/// The layer a Hugging Face tensor name belongs to, if any.
pub fn layer_of(name: &str) -> Option<u32> {
    name.strip_prefix("model.layers.")?
        .split_once('.')?
        .0
        .parse()
        .ok()
}

/// Number of heads whose rows llama.cpp permutes for this tensor, or None when the
/// tensor is not permuted. `gguf_arch` is `general.architecture`.
pub fn rope_permute_heads(
    gguf_arch: Option<&str>,
    hf_name: &str,
    n_heads: u32,
    n_kv_heads: u32,
) -> Option<u32> {
    if gguf_arch != Some("llama") {
        return None;
    }
    if hf_name.ends_with("self_attn.q_proj.weight") || hf_name.ends_with("self_attn.q_proj.bias") {
        Some(n_heads)
    } else if hf_name.ends_with("self_attn.k_proj.weight")
        || hf_name.ends_with("self_attn.k_proj.bias")
    {
        Some(n_kv_heads)
    } else {
        None
    }
}

/// Row `g` of the permuted (GGUF) tensor comes from this row of the HF tensor.
/// `rows` is the tensor's row count, `heads` from [`rope_permute_heads`].
pub fn gguf_row_to_hf(g: u64, rows: u64, heads: u32) -> u64 {
    let hd = rows / heads as u64;
    let half = hd / 2;
    let (h, w) = (g / hd, g % hd);
    h * hd + (w % 2) * half + w / 2
}

/// Inverse of [`gguf_row_to_hf`]: where HF row `r` lands in the GGUF tensor.
pub fn hf_row_to_gguf(r: u64, rows: u64, heads: u32) -> u64 {
    let hd = rows / heads as u64;
    let half = hd / 2;
    let (h, w) = (r / hd, r % hd);
    h * hd + (w % half) * 2 + w / half
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for n in [
            "model.embed_tokens.weight",
            "lm_head.weight",
            "model.norm.weight",
            "model.layers.17.self_attn.k_proj.weight",
            "model.layers.0.mlp.down_proj.weight",
            "model.layers.3.post_attention_layernorm.weight",
        ] {
            let g = hf_to_gguf(n).unwrap();
            assert_eq!(gguf_to_hf(&g).unwrap(), n);
        }
        assert_eq!(
            hf_to_gguf("model.layers.2.self_attn.q_proj.weight").unwrap(),
            "blk.2.attn_q.weight"
        );
        assert_eq!(hf_to_gguf("model.rotary_emb.inv_freq"), None);
        assert_eq!(layer_of("model.layers.12.mlp.up_proj.weight"), Some(12));
    }

    /// Matches llama.cpp's `w.reshape(n_head, 2, hd/2, ...).swapaxes(1, 2)`.
    #[test]
    fn permutation_matches_reshape_swapaxes() {
        let (heads, hd) = (3u64, 8u64);
        let rows = heads * hd;
        for h in 0..heads {
            for i in 0..hd / 2 {
                for j in 0..2 {
                    let hf = h * hd + j * (hd / 2) + i;
                    let gg = h * hd + i * 2 + j;
                    assert_eq!(gguf_row_to_hf(gg, rows, heads as u32), hf);
                    assert_eq!(hf_row_to_gguf(hf, rows, heads as u32), gg);
                }
            }
        }
    }
}
