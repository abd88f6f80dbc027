//! llama-quantize's file-type presets (`Q4_K_M`, `Q8_0` …): which ggml type each tensor
//! of a model gets, reimplemented from llama.cpp 0.3.36 (`src/llama-quant.cpp`) so a
//! quantized `model.gguf` view holds the same types as `llama-quantize F32.gguf out PRESET`
//! would write (no imatrix, no overrides, default options).
//!
//! The choice, per tensor, as llama-quantize makes it:
//! 1. Only tensors of two or more dimensions whose name ends in `weight` are quantized,
//!    minus norms, MoE gates, positional embeddings and a list of small special tensors;
//!    the rest keep their input type (F32 in an all-F32 input).
//! 2. A float preset (F32/F16/BF16) gives every quantizable tensor its type, nothing more.
//! 3. A quantized preset starts from its default type and adjusts it by tensor category
//!    (output, token embedding, attn_v, ffn_down …), by position among its peers
//!    (`use_more_bits`: the first and last eighth of the layers and every third one
//!    between) and by model shape (GQA ratio, 8 experts, 70B, falcon).
//! 4. A type whose block does not divide the row length (`ne[0]`) falls back: Q4_K→Q5_0,
//!    Q5_K→Q5_1, Q6_K→Q8_0, Q2_K/Q3_K→Q4_0, and to F16 when even that does not fit.
//!
//! Counters (the i-th attn_v, the i-th ffn_down) advance in the order llama-quantize
//! walks tensors, which is not the file order: its loader sorts by layer number (tensors
//! outside `blk.N.` first), then by name. [`preset_types`] takes any order and follows
//! that one internally.
//!
//! Presets whose rules name IQ/TQ/MXFP4 types are not offered (no such [`GgmlType`]), nor
//! Q2_K_S, which llama-quantize refuses without an importance matrix; their branches are
//! left out, which changes no result for the presets here.

use crate::gguf::GgmlType;

use super::LayoutError;

/// A llama-quantize file type (ftype) preset.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum Preset {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2_K,
    Q3_K_S,
    Q3_K_M,
    Q3_K_L,
    Q4_K_S,
    Q4_K_M,
    Q5_K_S,
    Q5_K_M,
    Q6_K,
}

/// (preset, llama-quantize's name, `llama_ftype` id, default tensor type).
const TABLE: &[(Preset, &str, u32, GgmlType)] = &[
    (Preset::F32, "F32", 0, GgmlType::F32),
    (Preset::F16, "F16", 1, GgmlType::F16),
    (Preset::BF16, "BF16", 32, GgmlType::BF16),
    (Preset::Q4_0, "Q4_0", 2, GgmlType::Q4_0),
    (Preset::Q4_1, "Q4_1", 3, GgmlType::Q4_1),
    (Preset::Q5_0, "Q5_0", 8, GgmlType::Q5_0),
    (Preset::Q5_1, "Q5_1", 9, GgmlType::Q5_1),
    (Preset::Q8_0, "Q8_0", 7, GgmlType::Q8_0),
    (Preset::Q2_K, "Q2_K", 10, GgmlType::Q2_K),
    (Preset::Q3_K_S, "Q3_K_S", 11, GgmlType::Q3_K),
    (Preset::Q3_K_M, "Q3_K_M", 12, GgmlType::Q3_K),
    (Preset::Q3_K_L, "Q3_K_L", 13, GgmlType::Q3_K),
    (Preset::Q4_K_S, "Q4_K_S", 14, GgmlType::Q4_K),
    (Preset::Q4_K_M, "Q4_K_M", 15, GgmlType::Q4_K),
    (Preset::Q5_K_S, "Q5_K_S", 16, GgmlType::Q5_K),
    (Preset::Q5_K_M, "Q5_K_M", 17, GgmlType::Q5_K),
    (Preset::Q6_K, "Q6_K", 18, GgmlType::Q6_K),
];

/// llama-quantize's short names for the medium K-quant mixes.
const ALIASES: &[(&str, Preset)] = &[
    ("Q3_K", Preset::Q3_K_M),
    ("Q4_K", Preset::Q4_K_M),
    ("Q5_K", Preset::Q5_K_M),
];

impl Preset {
    /// Every preset, in llama_ftype order of the float types first, then by size.
    pub const ALL: &'static [Preset] = &[
        Preset::F32,
        Preset::F16,
        Preset::BF16,
        Preset::Q4_0,
        Preset::Q4_1,
        Preset::Q5_0,
        Preset::Q5_1,
        Preset::Q8_0,
        Preset::Q2_K,
        Preset::Q3_K_S,
        Preset::Q3_K_M,
        Preset::Q3_K_L,
        Preset::Q4_K_S,
        Preset::Q4_K_M,
        Preset::Q5_K_S,
        Preset::Q5_K_M,
        Preset::Q6_K,
    ];

    fn row(self) -> &'static (Preset, &'static str, u32, GgmlType) {
        // TABLE lists every variant (a unit test checks it).
        TABLE
            .iter()
            .find(|r| r.0 == self)
            .expect("every preset is in TABLE")
    }

    /// The name llama-quantize takes and prints, e.g. `Q4_K_M`.
    pub fn name(self) -> &'static str {
        self.row().1
    }

    /// A preset by name, any case, as llama-quantize accepts it (`q4_k_m`, `Q4_K`).
    pub fn parse(s: &str) -> Option<Preset> {
        let s = s.to_ascii_uppercase();
        TABLE
            .iter()
            .find(|r| r.1 == s)
            .map(|r| r.0)
            .or_else(|| ALIASES.iter().find(|a| a.0 == s).map(|a| a.1))
    }

    /// llama.cpp's `llama_ftype` id, written as `general.file_type`.
    pub fn ftype(self) -> u32 {
        self.row().2
    }

    /// The type a quantizable tensor gets before per-tensor adjustments
    /// (`llama_ftype_get_default_type`).
    pub fn default_type(self) -> GgmlType {
        self.row().3
    }

    fn is_float(self) -> bool {
        matches!(self, Preset::F32 | Preset::F16 | Preset::BF16)
    }
}

/// The model-wide facts llama-quantize consults, from the GGUF metadata.
#[derive(Clone, Copy, Debug)]
pub struct PresetModel<'a> {
    /// `general.architecture`.
    pub arch: &'a str,
    /// `{arch}.block_count` (all layers; models with MTP/next-n layers are not covered).
    pub n_layers: u32,
    /// `{arch}.attention.head_count` and `head_count_kv` (of layer 0 when per layer).
    pub n_head: u32,
    pub n_head_kv: u32,
    /// `{arch}.expert_count`, 0 for a dense model.
    pub n_expert: u32,
}

impl PresetModel<'_> {
    fn n_gqa(&self) -> u32 {
        self.n_head.checked_div(self.n_head_kv).unwrap_or(0)
    }

    /// llama.cpp gives 70B models more bits on attn_v. It knows a model as 70B by its
    /// layer count, per architecture (`load_arch_hparams`).
    fn is_70b(&self) -> bool {
        match self.arch {
            "llama" => self.n_expert != 8 && self.n_layers == 80 && self.n_head != self.n_head_kv,
            "deci" | "olmo" | "qwen2" => self.n_layers == 80,
            "jais2" => self.n_layers == 68,
            _ => false,
        }
    }
}

/// One tensor as llama-quantize sees it: GGUF name (`blk.3.attn_v.weight`) and ggml
/// shape (`ne[0]`, the row length, first).
#[derive(Clone, Copy, Debug)]
pub struct PresetTensor<'a> {
    pub name: &'a str,
    pub ne: &'a [u64],
}

/// llama-quantize's coarse tensor classes (`tensor_get_category`); the first match wins.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Category {
    TokenEmbd,
    AttnQ,
    AttnV,
    AttnK,
    AttnQkv,
    AttnKvB,
    AttnOutput,
    FfnUp,
    FfnGate,
    FfnDown,
    Output,
    Other,
}

fn category(name: &str) -> Category {
    if name == "output.weight" {
        return Category::Output;
    }
    if name == "token_embd.weight" || name == "per_layer_token_embd.weight" {
        return Category::TokenEmbd;
    }
    const BY_SUBSTRING: &[(&str, Category)] = &[
        ("attn_qkv.weight", Category::AttnQkv),
        ("attn_kv_b.weight", Category::AttnKvB),
        ("attn_v.weight", Category::AttnV),
        ("attn_k.weight", Category::AttnK),
        ("attn_q.weight", Category::AttnQ),
        ("attn_output.weight", Category::AttnOutput),
        ("ffn_up", Category::FfnUp),
        ("ffn_gate", Category::FfnGate),
        ("ffn_down", Category::FfnDown),
    ];
    BY_SUBSTRING
        .iter()
        .find(|(s, _)| name.contains(s))
        .map_or(Category::Other, |&(_, c)| c)
}

/// attn_v and the fused tensors that contain it are the most sensitive to quantization
/// and share its rules and counter.
fn is_attn_v_like(c: Category) -> bool {
    matches!(c, Category::AttnV | Category::AttnQkv | Category::AttnKvB)
}

/// Name fragments llama-quantize never quantizes (small or special-purpose tensors).
const NEVER_QUANTIZED: &[&str] = &[
    "_norm.weight",
    "ffn_gate_inp.weight",
    "ffn_gate_tid2eid.weight",
    "altup",
    "laurel",
    "per_layer_model_proj",
    "ssm_conv1d",
    "shortconv.conv.weight",
    "indexer.k_proj.weight",
    "indexer.q_proj.weight",
    "time_mix_first.weight",
    "time_mix_w0.weight",
    "time_mix_w1.weight",
    "time_mix_w2.weight",
    "time_mix_v0.weight",
    "time_mix_v1.weight",
    "time_mix_v2.weight",
    "time_mix_a0.weight",
    "time_mix_a1.weight",
    "time_mix_a2.weight",
    "time_mix_g1.weight",
    "time_mix_g2.weight",
    "time_mix_decay_w1.weight",
    "time_mix_decay_w2.weight",
    "time_mix_lerp_fused.weight",
    "attn_rel_b.weight",
    ".position_embd",
    "sam.pos_embd",
    "sam.neck.",
    "sam.net_",
    ".rel_pos",
    ".patch_embd",
    ".patch_merger",
    "a.rvq.codebook",
    "mm.a.code_embd",
];

/// More fragments kept unquantized in glm5-next models.
const NEVER_QUANTIZED_GLM5_NEXT: &[&str] = &[
    "hc_",
    "indexer.attn_q_b",
    "indexer.attn_k",
    "indexer.proj",
    "indexer_compressor_gate",
    "indexer_compressor_ape",
    "ssm_f_a.weight",
    "ssm_f_b.weight",
    "ssm_g_a.weight",
    "ssm_g_b.weight",
    "ssm_beta.weight",
    "attn_kv_a_mqa.weight",
    "attn_k_b.weight",
    "attn_v_b.weight",
];

/// ggml's dimension count: trailing sizes of 1 do not count, so `[576, 1]` is 1-D.
fn n_dims(ne: &[u64]) -> usize {
    ne.iter().rposition(|&n| n != 1).map_or(1, |i| i + 1)
}

/// 2-D tensors llama-quantize never quantizes and llama.cpp's converter writes in F32
/// (`convert_hf_to_gguf.py`'s "always in float32" list, the ones of the architectures
/// served here): every view serves them in F32, as 1-D ones.
pub(super) const ALWAYS_F32: [&str; 2] = ["position_embd.weight", "token_types.weight"];

/// `tensor_allows_quantization`.
pub(super) fn allows_quantization(arch: &str, t: &PresetTensor<'_>) -> bool {
    let name = t.name;
    n_dims(t.ne) >= 2
        && name.ends_with("weight")
        && !ALWAYS_F32.contains(&name)
        && !NEVER_QUANTIZED.iter().any(|s| name.contains(s))
        && (arch != "glm5-next" || !NEVER_QUANTIZED_GLM5_NEXT.iter().any(|s| name.contains(s)))
}

/// The layer of a `blk.N.` name the way llama.cpp reads it (`sscanf("blk.%d.")`).
fn blk_layer(name: &str) -> Option<i64> {
    let rest = name.strip_prefix("blk.")?.trim_start();
    let digits_at = usize::from(rest.starts_with(['+', '-']));
    let end = rest[digits_at..]
        .find(|c: char| !c.is_ascii_digit())
        .map_or(rest.len(), |e| e + digits_at);
    if end == digits_at {
        return None;
    }
    rest[..end].parse().ok()
}

/// llama-quantize's tensor order: its loader keys tensors by (layer, name), with -1 for
/// tensors outside the blocks.
fn quantize_order(tensors: &[PresetTensor<'_>]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..tensors.len()).collect();
    order.sort_by(|&a, &b| {
        let key = |i: usize| (blk_layer(tensors[i].name).unwrap_or(-1), tensors[i].name);
        key(a).cmp(&key(b))
    });
    order
}

/// Layers that get more bits in the medium mixes: the first and last eighth, and every
/// third layer in between.
fn use_more_bits(i_layer: i64, n_layers: i64) -> bool {
    i_layer < n_layers / 8 || i_layer >= 7 * n_layers / 8 || (i_layer - n_layers / 8) % 3 == 2
}

fn block_len(t: GgmlType) -> u64 {
    t.block().0
}

/// Walk state: how many attn_v-like and ffn tensors were typed so far.
struct Counters {
    n_attention_wv: i64,
    i_attention_wv: i64,
    i_ffn_down: i64,
    i_ffn_gate: i64,
    i_ffn_up: i64,
}

/// The per-tensor adjustment of a quantized preset's default type
/// (`llama_tensor_get_type_impl`), before the shape fallback.
fn adjust(
    preset: Preset,
    model: &PresetModel<'_>,
    has_tied_embeddings: bool,
    c: &mut Counters,
    t: &PresetTensor<'_>,
    cat: Category,
) -> Result<GgmlType, LayoutError> {
    use GgmlType as T;
    use Preset as P;
    let default = preset.default_type();
    let name = t.name;
    let falcon = model.arch == "falcon";
    let n_layers = i64::from(model.n_layers);

    // glm5-next keeps its low-rank attention factors at Q8_0 or better.
    if model.arch == "glm5-next"
        && ["attn_q_a", "attn_q_b", "nextn.eh_proj"]
            .iter()
            .any(|s| name.contains(s))
    {
        return Ok(T::Q8_0);
    }

    // The position a ffn tensor's rules use: its walk count in a dense model; in an MoE
    // model experts are not consecutive, so its layer number, which must then exist.
    let layer_of = |counter: i64| -> Result<i64, LayoutError> {
        if model.n_expert <= 1 {
            return Ok(counter);
        }
        let l = blk_layer(name).ok_or_else(|| {
            LayoutError::Unsupported(format!("failed to determine layer for tensor {name}"))
        })?;
        if l < 0 || l >= n_layers {
            return Err(LayoutError::Unsupported(format!(
                "bad layer {l} for tensor {name}, must be in [0, {n_layers})"
            )));
        }
        Ok(l)
    };

    let mut ty = default;
    // A tied token embedding is also the output projection, so it gets the output's type.
    if cat == Category::Output || (has_tied_embeddings && cat == Category::TokenEmbd) {
        let nx = t.ne.first().copied().unwrap_or(0);
        if falcon || nx % block_len(default) != 0 {
            ty = T::Q8_0;
        } else if default != T::Q8_0 {
            ty = T::Q6_K;
        }
    } else if cat == Category::TokenEmbd {
        // Only IQ/TQ presets change an untied embedding.
    } else if is_attn_v_like(cat) {
        let i = c.i_attention_wv;
        match preset {
            P::Q2_K => ty = if model.n_gqa() >= 4 { T::Q4_K } else { T::Q3_K },
            P::Q3_K_M => ty = if i < 2 { T::Q5_K } else { T::Q4_K },
            P::Q3_K_L => ty = T::Q5_K,
            P::Q4_K_M | P::Q5_K_M if use_more_bits(i, c.n_attention_wv) => ty = T::Q6_K,
            P::Q4_K_S if i < 4 => ty = T::Q5_K,
            _ => {}
        }
        // In a 70B model 8 heads share one attn_v, a small tensor: more bits cost little.
        if model.is_70b() && matches!(ty, T::Q3_K | T::Q4_K) {
            ty = T::Q5_K;
        }
        if model.n_expert == 8 {
            ty = T::Q8_0;
        }
        c.i_attention_wv += 1;
    } else if cat == Category::AttnK {
        if model.n_expert == 8 {
            ty = T::Q8_0;
        }
    } else if cat == Category::AttnQ {
        // Only IQ3 presets change attn_q.
    } else if cat == Category::FfnDown {
        let i = layer_of(c.i_ffn_down)?;
        let more = use_more_bits(i, n_layers);
        match preset {
            P::Q2_K => ty = T::Q3_K,
            P::Q3_K_M => {
                ty = if i < n_layers / 16 {
                    T::Q5_K
                } else if !falcon || more {
                    T::Q4_K
                } else {
                    T::Q3_K
                }
            }
            P::Q3_K_L => ty = if falcon { T::Q4_K } else { T::Q5_K },
            P::Q4_K_M if falcon => {
                ty = if i < n_layers / 16 {
                    T::Q6_K
                } else if more {
                    T::Q5_K
                } else {
                    T::Q4_K
                }
            }
            P::Q4_K_M | P::Q5_K_M if more => ty = T::Q6_K,
            P::Q4_K_S if !falcon && i < n_layers / 8 => ty = T::Q5_K,
            _ => {}
        }
        c.i_ffn_down += 1;
    } else if cat == Category::AttnOutput {
        if !falcon {
            if model.n_expert == 8 {
                if matches!(
                    preset,
                    P::Q2_K | P::Q3_K_S | P::Q3_K_M | P::Q4_K_S | P::Q4_K_M
                ) {
                    ty = T::Q5_K;
                }
            } else {
                match preset {
                    P::Q2_K => ty = T::Q3_K,
                    P::Q3_K_M => ty = T::Q4_K,
                    P::Q3_K_L => ty = T::Q5_K,
                    _ => {}
                }
            }
        } else if preset == P::Q3_K_L {
            ty = T::Q4_K;
        }
    } else if cat == Category::FfnGate {
        // Only IQ3_XS changes ffn_gate/ffn_up, but the layer check still applies.
        layer_of(c.i_ffn_gate)?;
        c.i_ffn_gate += 1;
    } else if cat == Category::FfnUp {
        layer_of(c.i_ffn_up)?;
        c.i_ffn_up += 1;
    }
    Ok(ty)
}

/// `tensor_type_fallback`: a type whose block does not divide the row length is
/// replaced by a 32-block type of similar size, or F16 when nothing fits.
pub fn fallback(ty: GgmlType, ncols: u64) -> GgmlType {
    use GgmlType as T;
    if ncols % block_len(ty) == 0 {
        return ty;
    }
    let to = match ty {
        T::IQ4_XS
        | T::IQ3_S
        | T::IQ3_XXS
        | T::IQ2_S
        | T::IQ2_XS
        | T::IQ2_XXS
        | T::IQ1_S
        | T::IQ1_M => T::IQ4_NL,
        T::Q2_K | T::Q3_K => T::Q4_0,
        T::Q4_K => T::Q5_0,
        T::Q5_K => T::Q5_1,
        T::Q6_K => T::Q8_0,
        // A 32-block type has nothing smaller to go to: the check below makes it F16.
        other => other,
    };
    if ncols % block_len(to) != 0 {
        T::F16
    } else {
        to
    }
}

/// The type llama-quantize gives each tensor of `tensors` (returned in the same order),
/// and for a tensor whose chosen type did not fit its row length the type it wanted:
/// `(chosen, Some(wanted))`. Tensors llama-quantize does not quantize get F32, the type
/// they have in the all-F32 input the comparison assumes.
///
/// Fails where llama-quantize fails: in an MoE model, a ffn tensor without a valid
/// `blk.N.` layer.
pub fn preset_types(
    preset: Preset,
    model: &PresetModel<'_>,
    tensors: &[PresetTensor<'_>],
) -> Result<Vec<(GgmlType, Option<GgmlType>)>, LayoutError> {
    let cats: Vec<Category> = tensors.iter().map(|t| category(t.name)).collect();
    let has_tied_embeddings = !cats.contains(&Category::Output);
    let mut counters = Counters {
        n_attention_wv: cats.iter().filter(|&&c| is_attn_v_like(c)).count() as i64,
        i_attention_wv: 0,
        i_ffn_down: 0,
        i_ffn_gate: 0,
        i_ffn_up: 0,
    };
    let mut out = vec![(GgmlType::F32, None); tensors.len()];
    for i in quantize_order(tensors) {
        let t = &tensors[i];
        if !allows_quantization(model.arch, t) {
            continue;
        }
        let default = preset.default_type();
        if preset.is_float() {
            out[i] = (default, None);
            continue;
        }
        let wanted = adjust(
            preset,
            model,
            has_tied_embeddings,
            &mut counters,
            t,
            cats[i],
        )?;
        let chosen = fallback(wanted, t.ne.first().copied().unwrap_or(0));
        out[i] = (chosen, (chosen != wanted).then_some(wanted));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use GgmlType as T;

    /// A llama model's GGUF tensors in cawsfs's file order: (name, ne).
    fn llama_tensors(
        hidden: u64,
        ff: u64,
        kv_rows: u64,
        layers: u32,
        vocab: u64,
        tied: bool,
    ) -> Vec<(String, Vec<u64>)> {
        let mut v = vec![("token_embd.weight".to_string(), vec![hidden, vocab])];
        for l in 0..layers {
            let b = |s: &str| format!("blk.{l}.{s}");
            v.push((b("attn_norm.weight"), vec![hidden]));
            v.push((b("ffn_norm.weight"), vec![hidden]));
            v.push((b("attn_q.weight"), vec![hidden, hidden]));
            v.push((b("attn_k.weight"), vec![hidden, kv_rows]));
            v.push((b("attn_v.weight"), vec![hidden, kv_rows]));
            v.push((b("attn_output.weight"), vec![hidden, hidden]));
            v.push((b("ffn_gate.weight"), vec![hidden, ff]));
            v.push((b("ffn_up.weight"), vec![hidden, ff]));
            v.push((b("ffn_down.weight"), vec![ff, hidden]));
        }
        v.push(("output_norm.weight".to_string(), vec![hidden]));
        if !tied {
            v.push(("output.weight".to_string(), vec![hidden, vocab]));
        }
        v
    }

    /// SmolLM2-135M: 576 wide (not a multiple of 256), 30 layers, 9/3 heads, tied.
    fn smol() -> Vec<(String, Vec<u64>)> {
        llama_tensors(576, 1536, 192, 30, 49152, true)
    }

    fn model(n_layers: u32, n_head: u32, n_head_kv: u32) -> PresetModel<'static> {
        PresetModel {
            arch: "llama",
            n_layers,
            n_head,
            n_head_kv,
            n_expert: 0,
        }
    }

    /// name → (chosen, wanted) for `preset`.
    fn types(
        preset: Preset,
        m: &PresetModel<'_>,
        ts: &[(String, Vec<u64>)],
    ) -> Vec<(String, (GgmlType, Option<GgmlType>))> {
        let pts: Vec<PresetTensor<'_>> = ts
            .iter()
            .map(|(n, ne)| PresetTensor { name: n, ne })
            .collect();
        let got = preset_types(preset, m, &pts).unwrap();
        ts.iter().map(|(n, _)| n.clone()).zip(got).collect()
    }

    fn get(
        v: &[(String, (GgmlType, Option<GgmlType>))],
        name: &str,
    ) -> (GgmlType, Option<GgmlType>) {
        v.iter().find(|(n, _)| n == name).unwrap().1
    }

    #[test]
    fn table_is_complete_and_names_parse() {
        for &p in Preset::ALL {
            assert_eq!(Preset::parse(p.name()), Some(p));
            assert_eq!(Preset::parse(&p.name().to_lowercase()), Some(p));
        }
        assert_eq!(TABLE.len(), Preset::ALL.len());
        assert_eq!(Preset::parse("q4_k"), Some(Preset::Q4_K_M));
        assert_eq!(Preset::parse("Q4_K_X"), None);
        assert_eq!(Preset::Q4_K_M.ftype(), 15);
        assert_eq!(Preset::Q8_0.ftype(), 7);
        assert_eq!(Preset::Q5_K_S.default_type(), T::Q5_K);
    }

    #[test]
    fn norms_and_1d_tensors_stay_f32() {
        let ts = smol();
        for &p in Preset::ALL {
            let v = types(p, &model(30, 9, 3), &ts);
            assert_eq!(get(&v, "blk.0.attn_norm.weight"), (T::F32, None));
            assert_eq!(get(&v, "output_norm.weight"), (T::F32, None));
        }
        // [n, 1] is 1-D to ggml; a 2-D norm is still a norm.
        let odd = [
            ("blk.0.x.weight".to_string(), vec![256, 1]),
            ("blk.0.y_norm.weight".to_string(), vec![256, 4]),
            ("blk.0.ffn_gate_inp.weight".to_string(), vec![256, 8]),
            ("blk.0.attn_q.bias".to_string(), vec![256, 4]),
        ];
        for (_, (ty, _)) in types(Preset::Q4_K_M, &model(1, 1, 1), &odd) {
            assert_eq!(ty, T::F32);
        }
    }

    /// A tied embedding is the output projection: Q6_K when its rows fit 256-blocks;
    /// otherwise Q8_0 chosen directly (not a fallback) when the default type's own block
    /// does not fit, and a Q6_K→Q8_0 fallback when it does (Q4_0's 32).
    #[test]
    fn tied_embeddings_take_the_output_rules() {
        let ts = smol();
        let m = model(30, 9, 3);
        let e = "token_embd.weight";
        assert_eq!(get(&types(Preset::Q4_K_M, &m, &ts), e), (T::Q8_0, None));
        assert_eq!(
            get(&types(Preset::Q4_0, &m, &ts), e),
            (T::Q8_0, Some(T::Q6_K))
        );
        assert_eq!(get(&types(Preset::Q8_0, &m, &ts), e), (T::Q8_0, None));
        assert_eq!(get(&types(Preset::F16, &m, &ts), e), (T::F16, None));

        let wide = llama_tensors(512, 1536, 128, 4, 1000, true);
        let m4 = model(4, 8, 2);
        assert_eq!(get(&types(Preset::Q4_K_M, &m4, &wide), e), (T::Q6_K, None));
        assert_eq!(get(&types(Preset::Q5_1, &m4, &wide), e), (T::Q6_K, None));

        // Untied: the embedding keeps the default type, output.weight gets Q6_K.
        let untied = llama_tensors(512, 1536, 128, 4, 1000, false);
        let v = types(Preset::Q4_K_M, &m4, &untied);
        assert_eq!(get(&v, e), (T::Q4_K, None));
        assert_eq!(get(&v, "output.weight"), (T::Q6_K, None));
        let v = types(Preset::Q4_0, &m4, &untied);
        assert_eq!(get(&v, e), (T::Q4_0, None));
        assert_eq!(get(&v, "output.weight"), (T::Q6_K, None));
    }

    /// 576-wide rows cannot take 256-blocks: each K type falls back to its 32-block
    /// neighbour, while 1536-wide ffn_down keeps its K type.
    #[test]
    fn k_quants_fall_back_on_576_wide_rows() {
        let ts = smol();
        let m = model(30, 9, 3);
        let v = types(Preset::Q4_K_M, &m, &ts);
        assert_eq!(get(&v, "blk.1.attn_q.weight"), (T::Q5_0, Some(T::Q4_K)));
        assert_eq!(get(&v, "blk.1.ffn_up.weight"), (T::Q5_0, Some(T::Q4_K)));
        assert_eq!(get(&v, "blk.0.attn_v.weight"), (T::Q8_0, Some(T::Q6_K)));
        assert_eq!(get(&v, "blk.0.ffn_down.weight"), (T::Q6_K, None));
        assert_eq!(get(&v, "blk.3.ffn_down.weight"), (T::Q4_K, None));
        let v = types(Preset::Q5_K_S, &m, &ts);
        assert_eq!(get(&v, "blk.1.attn_k.weight"), (T::Q5_1, Some(T::Q5_K)));
        let v = types(Preset::Q3_K_S, &m, &ts);
        assert_eq!(get(&v, "blk.1.attn_k.weight"), (T::Q4_0, Some(T::Q3_K)));
        // Rows of 48 fit no block at all (not even 32): F16.
        let tiny = [("blk.0.attn_q.weight".to_string(), vec![48, 48])];
        let v = types(Preset::Q4_K_M, &model(1, 1, 1), &tiny);
        assert_eq!(v[0].1, (T::F16, Some(T::Q4_K)));
        let v = types(Preset::Q8_0, &model(1, 1, 1), &tiny);
        assert_eq!(v[0].1, (T::F16, Some(T::Q8_0)));
    }

    /// Everything 256-wide: no fallbacks; the medium mixes spend more bits where
    /// llama.cpp says.
    #[test]
    fn k_quant_path_on_256_multiples() {
        let ts = llama_tensors(256, 768, 64, 8, 1024, false);
        let m = model(8, 4, 1);
        for &p in Preset::ALL {
            for (n, (_, wanted)) in types(p, &m, &ts) {
                assert_eq!(wanted, None, "{p:?} {n}");
            }
        }
        let v = types(Preset::Q4_K_M, &m, &ts);
        // use_more_bits(i, 8): i < 1, i >= 7, (i - 1) % 3 == 2 → layers 0, 3, 6, 7.
        for l in 0..8 {
            let want = if [0, 3, 6, 7].contains(&l) {
                T::Q6_K
            } else {
                T::Q4_K
            };
            assert_eq!(get(&v, &format!("blk.{l}.attn_v.weight")).0, want, "{l}");
            assert_eq!(get(&v, &format!("blk.{l}.ffn_down.weight")).0, want, "{l}");
            assert_eq!(get(&v, &format!("blk.{l}.attn_q.weight")).0, T::Q4_K);
        }
        let v = types(Preset::Q4_K_S, &m, &ts);
        for l in 0..8 {
            let v_ty = if l < 4 { T::Q5_K } else { T::Q4_K };
            let d_ty = if l < 1 { T::Q5_K } else { T::Q4_K };
            assert_eq!(get(&v, &format!("blk.{l}.attn_v.weight")).0, v_ty);
            assert_eq!(get(&v, &format!("blk.{l}.ffn_down.weight")).0, d_ty);
        }
        let v = types(Preset::Q3_K_M, &m, &ts);
        assert_eq!(get(&v, "blk.1.attn_v.weight").0, T::Q5_K);
        assert_eq!(get(&v, "blk.2.attn_v.weight").0, T::Q4_K);
        assert_eq!(get(&v, "blk.2.attn_output.weight").0, T::Q4_K);
        assert_eq!(get(&v, "blk.2.ffn_down.weight").0, T::Q4_K);
        assert_eq!(get(&v, "blk.2.ffn_up.weight").0, T::Q3_K);
        // Q2_K: attn_v by GQA ratio (4 here), ffn_down and attn_output one step up.
        let v = types(Preset::Q2_K, &m, &ts);
        assert_eq!(get(&v, "blk.5.attn_v.weight").0, T::Q4_K);
        assert_eq!(get(&v, "blk.5.ffn_down.weight").0, T::Q3_K);
        assert_eq!(get(&v, "blk.5.attn_output.weight").0, T::Q3_K);
        assert_eq!(get(&v, "blk.5.attn_q.weight").0, T::Q2_K);
        let v = types(Preset::Q2_K, &model(8, 4, 2), &ts);
        assert_eq!(get(&v, "blk.5.attn_v.weight").0, T::Q3_K);
    }

    /// Counters follow llama-quantize's (layer, name) order, not the order given.
    #[test]
    fn counters_follow_layer_order() {
        let mut ts = llama_tensors(256, 768, 64, 8, 1024, false);
        ts.reverse();
        let v = types(Preset::Q4_K_S, &model(8, 4, 1), &ts);
        assert_eq!(get(&v, "blk.0.attn_v.weight").0, T::Q5_K);
        assert_eq!(get(&v, "blk.7.attn_v.weight").0, T::Q4_K);
        // "blk.10" sorts after "blk.9" (numerically, not as text).
        let ts = llama_tensors(256, 768, 64, 12, 1024, false);
        let mut shuffled = ts.clone();
        shuffled.sort_by(|a, b| a.0.cmp(&b.0));
        let a = types(Preset::Q4_K_M, &model(12, 4, 1), &ts);
        let mut b = types(Preset::Q4_K_M, &model(12, 4, 1), &shuffled);
        b.sort_by_key(|(n, _)| ts.iter().position(|(m, _)| m == n));
        assert_eq!(a, b);
        assert_eq!(blk_layer("blk.10.attn_v.weight"), Some(10));
        assert_eq!(blk_layer("token_embd.weight"), None);
        assert_eq!(blk_layer("blk.x"), None);
    }

    #[test]
    fn model_shape_rules() {
        let ts = llama_tensors(256, 768, 64, 80, 1024, false);
        let v = types(Preset::Q4_K_S, &model(80, 64, 8), &ts);
        assert_eq!(get(&v, "blk.50.attn_v.weight").0, T::Q5_K, "70B");
        let v = types(Preset::Q4_K_S, &model(80, 64, 64), &ts);
        assert_eq!(get(&v, "blk.50.attn_v.weight").0, T::Q4_K, "65B");
        let moe = PresetModel {
            n_expert: 8,
            ..model(80, 64, 8)
        };
        let v = types(Preset::Q4_K_S, &moe, &ts);
        assert_eq!(get(&v, "blk.50.attn_v.weight").0, T::Q8_0);
        assert_eq!(get(&v, "blk.50.attn_k.weight").0, T::Q8_0);
        assert_eq!(get(&v, "blk.50.attn_output.weight").0, T::Q5_K);
        // An MoE ffn tensor outside the layers is an error, as in llama-quantize.
        let bad = [("blk.99.ffn_down_exps.weight".to_string(), vec![256, 256, 8])];
        let pts: Vec<PresetTensor<'_>> = bad
            .iter()
            .map(|(n, ne)| PresetTensor { name: n, ne })
            .collect();
        assert!(preset_types(Preset::Q4_K_M, &moe, &pts).is_err());
        let falcon = PresetModel {
            arch: "falcon",
            ..model(8, 4, 1)
        };
        let v = types(
            Preset::Q4_K_M,
            &falcon,
            &llama_tensors(256, 768, 64, 8, 1024, false),
        );
        assert_eq!(get(&v, "output.weight").0, T::Q8_0);
    }
}
