//! Tensor naming and row order between the Hugging Face and llama.cpp conventions.
//!
//! llama.cpp's converter permutes the rows of Q and K projections of llama-architecture
//! models so its rotary embedding can rotate adjacent pairs: within each head of
//! `hd` rows, HF row `j*hd/2 + i` becomes GGUF row `2*i + j` (j ∈ {0,1}). Qwen2 uses
//! the NEOX rotary layout and is not permuted.

/// Hugging Face `model_type`s whose tensors this module can name for llama.cpp, and
/// the GGUF `general.architecture` of each.
pub const GGUF_ARCHS: [(&str, &str); 12] = [
    ("llama", "llama"),
    ("mistral", "llama"),
    // Mixture-of-experts: Mixtral is a llama with experts; Qwen2-MoE adds a shared
    // expert; Qwen3-MoE is Qwen3's attention with experts (no shared one); OLMoE
    // normalizes Q and K over the whole projection.
    ("mixtral", "llama"),
    ("qwen2_moe", "qwen2moe"),
    ("qwen3_moe", "qwen3moe"),
    ("olmoe", "olmoe"),
    ("qwen2", "qwen2"),
    ("qwen3", "qwen3"),
    ("phi3", "phi3"),
    ("bert", "bert"),
    ("gemma2", "gemma2"),
    ("gpt2", "gpt2"),
];

/// The GGUF `general.architecture` of a Hugging Face `model_type` in [`GGUF_ARCHS`];
/// None for any other (the mount serves no GGUF view).
pub fn gguf_arch_of(model_type: &str) -> Option<&'static str> {
    GGUF_ARCHS
        .iter()
        .find(|(m, _)| *m == model_type)
        .map(|(_, g)| *g)
}

/// How one family of architectures names its tensors on each side.
struct Naming {
    /// A prefix Hugging Face names may lack: GPT-2 checkpoints saved from `GPT2Model`
    /// (openai-community/gpt2's own) name `h.0.ln_1.weight` what `GPT2LMHeadModel`
    /// names `transformer.h.0.ln_1.weight`. The tables below carry it.
    optional_prefix: &'static str,
    /// Hugging Face prefix of a layer's tensors, before the layer number.
    layer_prefix: &'static str,
    /// Per-layer suffixes: (Hugging Face, GGUF).
    layers: &'static [(&'static str, &'static str)],
    /// A naming whose per-layer suffixes also apply, after these.
    base: Option<&'static Naming>,
    /// Tensors outside the layers: (Hugging Face, GGUF).
    globals: &'static [(&'static str, &'static str)],
    /// Per-expert tensors of a layer, `*` standing for the expert number: (Hugging
    /// Face, GGUF). llama.cpp stacks a layer's experts into one 3-D tensor.
    experts: &'static [(&'static str, &'static str)],
}

/// llama, mistral, qwen2, qwen3, and Mixtral (a llama with experts).
const LLAMA: Naming = Naming {
    base: None,
    optional_prefix: "",
    layer_prefix: "model.layers.",
    layers: &[
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
        // Mixtral's router.
        ("block_sparse_moe.gate.weight", "ffn_gate_inp.weight"),
    ],
    globals: &[
        ("model.embed_tokens.weight", "token_embd.weight"),
        ("model.norm.weight", "output_norm.weight"),
        ("lm_head.weight", "output.weight"),
    ],
    experts: &[
        (
            "block_sparse_moe.experts.*.w1.weight",
            "ffn_gate_exps.weight",
        ),
        (
            "block_sparse_moe.experts.*.w2.weight",
            "ffn_down_exps.weight",
        ),
        ("block_sparse_moe.experts.*.w3.weight", "ffn_up_exps.weight"),
    ],
};

/// Qwen2-MoE, Qwen3-MoE and OLMoE: the llama layout (Qwen3-MoE's Q and K norms are
/// per head, OLMoE's span the whole projections) with a router, experts, and
/// Qwen2-MoE's shared expert behind its gate.
const QWEN_MOE: Naming = Naming {
    optional_prefix: "",
    layer_prefix: "model.layers.",
    layers: &[
        ("mlp.gate.weight", "ffn_gate_inp.weight"),
        (
            "mlp.shared_expert.gate_proj.weight",
            "ffn_gate_shexp.weight",
        ),
        ("mlp.shared_expert.up_proj.weight", "ffn_up_shexp.weight"),
        (
            "mlp.shared_expert.down_proj.weight",
            "ffn_down_shexp.weight",
        ),
        ("mlp.shared_expert_gate.weight", "ffn_gate_inp_shexp.weight"),
    ],
    // Attention and dense layers (Qwen2-MoE's `mlp_only_layers`) as llama's; these
    // come first, so their router is `mlp.gate`.
    base: Some(&LLAMA),
    globals: LLAMA.globals,
    experts: &[
        ("mlp.experts.*.gate_proj.weight", "ffn_gate_exps.weight"),
        ("mlp.experts.*.up_proj.weight", "ffn_up_exps.weight"),
        ("mlp.experts.*.down_proj.weight", "ffn_down_exps.weight"),
    ],
};

/// Phi-3: the llama layout with fused Q/K/V and gate/up projections (`ffn_up` holds
/// gate then up, which llama.cpp's SwiGLU splits in halves).
const PHI3: Naming = Naming {
    base: None,
    optional_prefix: "",
    layer_prefix: "model.layers.",
    layers: &[
        ("input_layernorm.weight", "attn_norm.weight"),
        ("post_attention_layernorm.weight", "ffn_norm.weight"),
        ("self_attn.qkv_proj.weight", "attn_qkv.weight"),
        ("self_attn.o_proj.weight", "attn_output.weight"),
        ("mlp.gate_up_proj.weight", "ffn_up.weight"),
        ("mlp.down_proj.weight", "ffn_down.weight"),
    ],
    globals: LLAMA.globals,
    experts: &[],
};

/// Gemma 2: four norms per layer (around attention and around the MLP), the output
/// head tied to the embedding.
const GEMMA2: Naming = Naming {
    base: None,
    optional_prefix: "",
    layer_prefix: "model.layers.",
    layers: &[
        ("input_layernorm.weight", "attn_norm.weight"),
        (
            "post_attention_layernorm.weight",
            "post_attention_norm.weight",
        ),
        ("pre_feedforward_layernorm.weight", "ffn_norm.weight"),
        ("post_feedforward_layernorm.weight", "post_ffw_norm.weight"),
        ("self_attn.q_proj.weight", "attn_q.weight"),
        ("self_attn.k_proj.weight", "attn_k.weight"),
        ("self_attn.v_proj.weight", "attn_v.weight"),
        ("self_attn.o_proj.weight", "attn_output.weight"),
        ("mlp.gate_proj.weight", "ffn_gate.weight"),
        ("mlp.up_proj.weight", "ffn_up.weight"),
        ("mlp.down_proj.weight", "ffn_down.weight"),
    ],
    globals: &[
        ("model.embed_tokens.weight", "token_embd.weight"),
        ("model.norm.weight", "output_norm.weight"),
    ],
    experts: &[],
};

/// BERT encoders (llama.cpp's `bert`; `position_ids` and the pooler have no GGUF name).
const BERT: Naming = Naming {
    base: None,
    optional_prefix: "",
    layer_prefix: "encoder.layer.",
    layers: &[
        ("attention.self.query.weight", "attn_q.weight"),
        ("attention.self.query.bias", "attn_q.bias"),
        ("attention.self.key.weight", "attn_k.weight"),
        ("attention.self.key.bias", "attn_k.bias"),
        ("attention.self.value.weight", "attn_v.weight"),
        ("attention.self.value.bias", "attn_v.bias"),
        ("attention.output.dense.weight", "attn_output.weight"),
        ("attention.output.dense.bias", "attn_output.bias"),
        (
            "attention.output.LayerNorm.weight",
            "attn_output_norm.weight",
        ),
        ("attention.output.LayerNorm.bias", "attn_output_norm.bias"),
        ("intermediate.dense.weight", "ffn_up.weight"),
        ("intermediate.dense.bias", "ffn_up.bias"),
        ("output.dense.weight", "ffn_down.weight"),
        ("output.dense.bias", "ffn_down.bias"),
        ("output.LayerNorm.weight", "layer_output_norm.weight"),
        ("output.LayerNorm.bias", "layer_output_norm.bias"),
    ],
    globals: &[
        ("embeddings.word_embeddings.weight", "token_embd.weight"),
        (
            "embeddings.token_type_embeddings.weight",
            "token_types.weight",
        ),
        (
            "embeddings.position_embeddings.weight",
            "position_embd.weight",
        ),
        ("embeddings.LayerNorm.weight", "token_embd_norm.weight"),
        ("embeddings.LayerNorm.bias", "token_embd_norm.bias"),
    ],
    experts: &[],
};

/// GPT-2: fused Q/K/V, LayerNorms with biases, learned positions, the output head
/// tied to the embedding. Its four projection matrices are `Conv1D`s, stored
/// `[in, out]`: llama.cpp's converter transposes them ([`transposed`]).
const GPT2: Naming = Naming {
    base: None,
    optional_prefix: "transformer.",
    layer_prefix: "transformer.h.",
    layers: &[
        ("ln_1.weight", "attn_norm.weight"),
        ("ln_1.bias", "attn_norm.bias"),
        ("attn.c_attn.weight", "attn_qkv.weight"),
        ("attn.c_attn.bias", "attn_qkv.bias"),
        ("attn.c_proj.weight", "attn_output.weight"),
        ("attn.c_proj.bias", "attn_output.bias"),
        ("ln_2.weight", "ffn_norm.weight"),
        ("ln_2.bias", "ffn_norm.bias"),
        ("mlp.c_fc.weight", "ffn_up.weight"),
        ("mlp.c_fc.bias", "ffn_up.bias"),
        ("mlp.c_proj.weight", "ffn_down.weight"),
        ("mlp.c_proj.bias", "ffn_down.bias"),
    ],
    globals: &[
        ("transformer.wte.weight", "token_embd.weight"),
        ("transformer.wpe.weight", "position_embd.weight"),
        ("transformer.ln_f.weight", "output_norm.weight"),
        ("transformer.ln_f.bias", "output_norm.bias"),
        ("lm_head.weight", "output.weight"),
    ],
    experts: &[],
};

const NAMINGS: [&Naming; 5] = [&LLAMA, &PHI3, &BERT, &GPT2, &QWEN_MOE];

/// The naming of a GGUF architecture.
fn naming(gguf_arch: &str) -> Option<&'static Naming> {
    match gguf_arch {
        "llama" | "qwen2" | "qwen3" => Some(&LLAMA),
        "qwen2moe" | "qwen3moe" | "olmoe" => Some(&QWEN_MOE),
        "bert" => Some(&BERT),
        "phi3" => Some(&PHI3),
        "gemma2" => Some(&GEMMA2),
        "gpt2" => Some(&GPT2),
        _ => None,
    }
}

impl Naming {
    fn layer_pairs(&self) -> impl Iterator<Item = &(&'static str, &'static str)> {
        let base = self.base.map_or(&[][..], |b| b.layers);
        self.layers.iter().chain(base)
    }

    fn to_gguf(&self, name: &str) -> Option<String> {
        let p = self.optional_prefix;
        if !p.is_empty() && !name.starts_with(p) && name != "lm_head.weight" {
            return self.to_gguf(&format!("{p}{name}"));
        }
        if let Some((_, g)) = self.globals.iter().find(|(h, _)| *h == name) {
            return Some(g.to_string());
        }
        let rest = name.strip_prefix(self.layer_prefix)?;
        let (layer, suffix) = rest.split_once('.')?;
        let layer: u32 = layer.parse().ok()?;
        let (_, g) = self.layer_pairs().find(|(h, _)| *h == suffix)?;
        Some(format!("blk.{layer}.{g}"))
    }

    /// A per-expert tensor's GGUF name (of the stacked tensor) and expert number.
    fn expert_to_gguf(&self, name: &str) -> Option<(String, u32)> {
        let rest = name.strip_prefix(self.layer_prefix)?;
        let (layer, suffix) = rest.split_once('.')?;
        let layer: u32 = layer.parse().ok()?;
        self.experts.iter().find_map(|(h, g)| {
            let (before, after) = h.split_once('*')?;
            let (e, tail) = suffix.strip_prefix(before)?.split_once('.')?;
            // Digits only: `u32::from_str` would take a leading `+`.
            let e = e
                .bytes()
                .all(|b| b.is_ascii_digit())
                .then(|| e.parse::<u32>().ok())??;
            (tail == &after[1..]).then(|| (format!("blk.{layer}.{g}"), e))
        })
    }

    /// Expert `e` of the stacked GGUF tensor `name` (`blk.L.ffn_up_exps.weight`).
    fn expert_to_hf(&self, name: &str, e: u64) -> Option<String> {
        let (layer, suffix) = name.strip_prefix("blk.")?.split_once('.')?;
        let layer: u32 = layer.parse().ok()?;
        let (h, _) = self.experts.iter().find(|(_, g)| *g == suffix)?;
        Some(format!(
            "{}{layer}.{}",
            self.layer_prefix,
            h.replacen('*', &e.to_string(), 1)
        ))
    }

    fn to_hf(&self, name: &str) -> Option<String> {
        if let Some((h, _)) = self.globals.iter().find(|(_, g)| *g == name) {
            return Some(h.to_string());
        }
        let rest = name.strip_prefix("blk.")?;
        let (layer, suffix) = rest.split_once('.')?;
        let layer: u32 = layer.parse().ok()?;
        let (h, _) = self.layer_pairs().find(|(_, g)| *g == suffix)?;
        Some(format!("{}{layer}.{h}", self.layer_prefix))
    }
}

/// Hugging Face name → llama.cpp name, or None for a tensor llama.cpp has no name for.
/// The name alone decides for the weights an importance matrix covers (the same in
/// every family); a norm can differ by architecture: [`hf_to_gguf_in`].
pub fn hf_to_gguf(name: &str) -> Option<String> {
    NAMINGS.iter().find_map(|n| n.to_gguf(name))
}

/// Hugging Face name → llama.cpp name in the naming of GGUF architecture `gguf_arch`.
pub fn hf_to_gguf_in(gguf_arch: &str, name: &str) -> Option<String> {
    naming(gguf_arch)?.to_gguf(name)
}

/// A per-expert Hugging Face tensor (`model.layers.3.mlp.experts.5.up_proj.weight`) →
/// the llama.cpp name of its layer's stacked experts (`blk.3.ffn_up_exps.weight`) and
/// its expert number; None for any other tensor.
pub fn hf_expert_to_gguf_in(gguf_arch: &str, name: &str) -> Option<(String, u32)> {
    naming(gguf_arch)?.expert_to_gguf(name)
}

/// The Hugging Face name of expert `e` of the stacked llama.cpp tensor `name`
/// (`blk.3.ffn_up_exps.weight` → `model.layers.3.mlp.experts.5.up_proj.weight`).
pub fn gguf_expert_to_hf(gguf_arch: &str, name: &str, e: u64) -> Option<String> {
    naming(gguf_arch)?.expert_to_hf(name, e)
}

/// What llama.cpp's converter adds to the values of this tensor: 1 for Gemma's RMS
/// norm weights (transformers scales by `1 + w`, llama.cpp by the stored weight).
pub fn value_shift(gguf_arch: &str, hf_name: &str) -> f32 {
    if gguf_arch == "gemma2" && hf_name.ends_with("norm.weight") {
        1.0
    } else {
        0.0
    }
}

/// llama.cpp name → Hugging Face name, in the naming of GGUF architecture `gguf_arch`
/// (`blk.0.attn_q.weight` is a different tensor in a llama and in a BERT).
pub fn gguf_to_hf(gguf_arch: &str, name: &str) -> Option<String> {
    naming(gguf_arch)?.to_hf(name)
}

/// The layer a Hugging Face tensor name belongs to, if any.
pub fn layer_of(name: &str) -> Option<u32> {
    NAMINGS
        .iter()
        .find_map(|n| {
            let bare = n.layer_prefix.strip_prefix(n.optional_prefix)?;
            name.strip_prefix(n.layer_prefix)
                .or_else(|| name.strip_prefix(bare).filter(|_| !bare.is_empty()))
        })?
        .split_once('.')?
        .0
        .parse()
        .ok()
}

/// Whether llama.cpp's converter transposes this tensor: GPT-2's `Conv1D` weights,
/// stored `[in, out]` where every other linear layer is `[out, in]`.
pub fn transposed(gguf_arch: &str, hf_name: &str) -> bool {
    gguf_arch == "gpt2"
        && [
            "attn.c_attn.weight",
            "attn.c_proj.weight",
            "mlp.c_fc.weight",
            "mlp.c_proj.weight",
        ]
        .iter()
        .any(|s| hf_name.ends_with(s))
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
            assert_eq!(gguf_to_hf("llama", &g).unwrap(), n);
        }
        assert_eq!(
            hf_to_gguf("model.layers.2.self_attn.q_proj.weight").unwrap(),
            "blk.2.attn_q.weight"
        );
        assert_eq!(hf_to_gguf("model.rotary_emb.inv_freq"), None);
        assert_eq!(layer_of("model.layers.12.mlp.up_proj.weight"), Some(12));
        // BERT's names, and the same GGUF name meaning another tensor there.
        for n in [
            "embeddings.word_embeddings.weight",
            "embeddings.LayerNorm.bias",
            "encoder.layer.5.attention.self.query.weight",
            "encoder.layer.0.output.LayerNorm.weight",
        ] {
            let g = hf_to_gguf(n).unwrap();
            assert_eq!(gguf_to_hf("bert", &g).unwrap(), n);
        }
        assert_eq!(
            gguf_to_hf("bert", "blk.1.attn_q.weight").unwrap(),
            "encoder.layer.1.attention.self.query.weight"
        );
        assert_eq!(layer_of("encoder.layer.10.output.dense.bias"), Some(10));
        assert_eq!(hf_to_gguf("embeddings.position_ids"), None);
        assert_eq!(gguf_to_hf("gpt2", "blk.0.attn_q.weight"), None);
        // GPT-2, with and without GPT2LMHeadModel's prefix; its Conv1D weights.
        for n in ["transformer.h.3.mlp.c_fc.weight", "h.3.mlp.c_fc.weight"] {
            assert_eq!(hf_to_gguf_in("gpt2", n).unwrap(), "blk.3.ffn_up.weight");
            assert_eq!(layer_of(n), Some(3));
            assert!(transposed("gpt2", n));
        }
        assert_eq!(
            hf_to_gguf_in("gpt2", "wpe.weight").unwrap(),
            "position_embd.weight"
        );
        assert_eq!(
            gguf_to_hf("gpt2", "blk.0.attn_qkv.bias").unwrap(),
            "transformer.h.0.attn.c_attn.bias"
        );
        assert!(!transposed("gpt2", "transformer.h.0.attn.c_attn.bias"));
        assert!(!transposed("llama", "model.layers.0.mlp.c_fc.weight"));
        // Phi-3's fused projections; its ffn_up is the fused gate/up.
        let n = "model.layers.3.self_attn.qkv_proj.weight";
        assert_eq!(hf_to_gguf(n).unwrap(), "blk.3.attn_qkv.weight");
        assert_eq!(gguf_to_hf("phi3", "blk.3.attn_qkv.weight").unwrap(), n);
        assert_eq!(
            gguf_to_hf("phi3", "blk.0.ffn_up.weight").unwrap(),
            "model.layers.0.mlp.gate_up_proj.weight"
        );
        assert_eq!(
            gguf_to_hf("llama", "blk.0.ffn_up.weight").unwrap(),
            "model.layers.0.mlp.up_proj.weight"
        );
        // Experts: Mixtral's and Qwen2-MoE's / Qwen3-MoE's / OLMoE's names, stacked per
        // layer.
        for (arch, n, g, e) in [
            (
                "llama",
                "model.layers.3.block_sparse_moe.experts.5.w2.weight",
                "blk.3.ffn_down_exps.weight",
                5,
            ),
            (
                "llama",
                "model.layers.0.block_sparse_moe.experts.12.w1.weight",
                "blk.0.ffn_gate_exps.weight",
                12,
            ),
            (
                "qwen2moe",
                "model.layers.1.mlp.experts.0.up_proj.weight",
                "blk.1.ffn_up_exps.weight",
                0,
            ),
            (
                "qwen3moe",
                "model.layers.47.mlp.experts.127.gate_proj.weight",
                "blk.47.ffn_gate_exps.weight",
                127,
            ),
            (
                "olmoe",
                "model.layers.15.mlp.experts.63.down_proj.weight",
                "blk.15.ffn_down_exps.weight",
                63,
            ),
        ] {
            assert_eq!(
                hf_expert_to_gguf_in(arch, n),
                Some((g.to_string(), e)),
                "{n}"
            );
            assert_eq!(hf_to_gguf_in(arch, n), None, "{n}");
            assert_eq!(
                layer_of(n),
                n.split('.').nth(2).and_then(|l| l.parse().ok())
            );
        }
        for n in [
            "model.layers.1.mlp.experts.x.up_proj.weight",
            "model.layers.1.mlp.experts.+1.up_proj.weight",
            "model.layers.1.mlp.experts.1.up_proj.bias",
            "model.layers.1.mlp.experts.1.w1.weight",
            "model.layers.1.mlp.shared_expert.up_proj.weight",
        ] {
            assert_eq!(hf_expert_to_gguf_in("qwen2moe", n), None, "{n}");
        }
        assert_eq!(
            hf_expert_to_gguf_in("gpt2", "model.layers.1.mlp.experts.1.up_proj.weight"),
            None
        );
        assert_eq!(
            hf_expert_to_gguf_in("llama", "model.layers.1.mlp.experts.1.up_proj.weight"),
            None
        );
        // And back, per architecture: the router is Mixtral's or Qwen2-MoE's.
        assert_eq!(
            gguf_expert_to_hf("olmoe", "blk.15.ffn_down_exps.weight", 63).unwrap(),
            "model.layers.15.mlp.experts.63.down_proj.weight"
        );
        assert_eq!(
            gguf_expert_to_hf("llama", "blk.0.ffn_gate_exps.weight", 2).unwrap(),
            "model.layers.0.block_sparse_moe.experts.2.w1.weight"
        );
        assert_eq!(gguf_expert_to_hf("llama", "blk.0.ffn_gate.weight", 2), None);
        assert_eq!(
            gguf_to_hf("qwen2moe", "blk.1.ffn_gate_inp.weight").unwrap(),
            "model.layers.1.mlp.gate.weight"
        );
        // Qwen3-MoE: Qwen3's per-head Q/K norms, the Qwen router, no Q/K permutation.
        assert_eq!(gguf_arch_of("qwen3_moe"), Some("qwen3moe"));
        assert_eq!(
            gguf_to_hf("qwen3moe", "blk.1.ffn_gate_inp.weight").unwrap(),
            "model.layers.1.mlp.gate.weight"
        );
        assert_eq!(
            hf_to_gguf_in("qwen3moe", "model.layers.0.self_attn.k_norm.weight").unwrap(),
            "blk.0.attn_k_norm.weight"
        );
        assert_eq!(
            rope_permute_heads(
                Some("qwen3moe"),
                "model.layers.0.self_attn.q_proj.weight",
                4,
                2
            ),
            None
        );
        assert_eq!(
            gguf_to_hf("llama", "blk.1.ffn_gate_inp.weight").unwrap(),
            "model.layers.1.block_sparse_moe.gate.weight"
        );
        assert_eq!(
            hf_to_gguf_in("qwen2moe", "model.layers.2.mlp.shared_expert_gate.weight").unwrap(),
            "blk.2.ffn_gate_inp_shexp.weight"
        );
        assert_eq!(
            hf_to_gguf_in("llama", "model.layers.2.block_sparse_moe.gate.weight").unwrap(),
            "blk.2.ffn_gate_inp.weight"
        );
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
