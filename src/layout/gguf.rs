//! `model.gguf` layout: GGUF v3 with llama.cpp tensor names, in llama.cpp's order
//! (token_embd, blocks in layer order, output_norm, output), each 2-D weight in the type
//! its view chose (`view.rs`) and 1-D tensors in F32 (llama.cpp expects F32 norms), Q/K
//! rows permuted for llama's rotary layout (whole rows, so ggml blocks stay intact). Metadata is kept from a GGUF source (file type updated) or
//! derived from `ArchConfig` and the Hugging Face side files.

use crate::gguf::{GgmlType, GgufHeader, GgufValue};
use crate::model::names;
use crate::model::ModelDesc;

use super::view::{self, GgufPlan};
use super::{tokenizer, Builder, LayoutError, VirtualFile};

/// Data alignment of the virtual GGUF (llama.cpp's default).
pub const ALIGNMENT: u64 = 32;

/// What the GGUF header serializer reports back: header bytes (padded to the data
/// start), each tensor's (offset, bytes) within the data section in the given order,
/// and the padded data section size.
pub(super) struct HeaderOut {
    pub bytes: Vec<u8>,
    pub entries: Vec<(u64, u64)>,
    pub data_size: u64,
}

pub(super) type HeaderFn<'a> = dyn Fn(
        Vec<(String, GgufValue)>,
        Vec<(String, Vec<u64>, GgmlType)>,
        u64,
    ) -> Result<HeaderOut, String>
    + 'a;

/// The real serializer: [`GgufHeader`].
pub(super) fn header_with_writer(
    meta: Vec<(String, GgufValue)>,
    tensors: Vec<(String, Vec<u64>, GgmlType)>,
    alignment: u64,
) -> Result<HeaderOut, String> {
    let h = GgufHeader::try_new(meta, tensors, alignment)?;
    Ok(HeaderOut {
        bytes: h.to_bytes(),
        entries: h.tensors.iter().map(|e| (e.offset, e.n_bytes)).collect(),
        data_size: h.data_size(),
    })
}

/// Tensors of `model.gguf`, in llama.cpp's order: (model indices, GGUF name). One index
/// for a tensor of its own; a layer's experts (`blk.N.ffn_*_exps`) are one GGUF tensor
/// stacking them in expert order, as llama.cpp's converter does.
pub(super) fn gguf_order(model: &ModelDesc) -> Result<Vec<(Vec<usize>, String)>, LayoutError> {
    let Some(arch) = model.arch.gguf_arch.as_deref() else {
        return Ok(Vec::new());
    };
    // (group, layer, sort name, expert, index, GGUF name)
    let mut v: Vec<(u32, u32, &str, u32, usize, String)> = Vec::new();
    let mut first_expert: std::collections::HashMap<String, &str> = Default::default();
    for (i, t) in model.tensors.iter().enumerate() {
        let (g, expert) = match names::hf_to_gguf_in(arch, &t.name) {
            Some(g) => (g, None),
            None => match names::hf_expert_to_gguf_in(arch, &t.name) {
                Some((g, e)) => (g, Some(e)),
                None => continue,
            },
        };
        // Embeddings (and their norm), the blocks, the output norm, the output.
        let layer = g
            .strip_prefix("blk.")
            .and_then(|r| r.split_once('.'))
            .and_then(|(l, _)| l.parse().ok());
        let (group, layer) = match (g.as_str(), layer) {
            (_, Some(l)) => (1, l),
            (n, _) if n.starts_with("output_norm.") => (2, 0),
            (n, _) if n.starts_with("output.") => (3, 0),
            _ => (0, 0),
        };
        if expert.is_some() {
            first_expert
                .entry(g.clone())
                .and_modify(|n| *n = (*n).min(t.name.as_str()))
                .or_insert(t.name.as_str());
        }
        v.push((group, layer, t.name.as_str(), expert.unwrap_or(0), i, g));
    }
    // A stack sorts where its first-named expert does.
    for e in v.iter_mut() {
        if let Some(n) = first_expert.get(&e.5) {
            e.2 = n;
        }
    }
    v.sort();
    let mut out: Vec<(Vec<usize>, String)> = Vec::new();
    let mut experts: Vec<u32> = Vec::new();
    for (_, _, _, e, i, g) in v {
        match out.last_mut() {
            Some((parts, name)) if *name == g => {
                parts.push(i);
                experts.push(e);
            }
            _ => {
                check_stack(model, out.last(), &experts)?;
                out.push((vec![i], g));
                experts = vec![e];
            }
        }
    }
    check_stack(model, out.last(), &experts)?;
    Ok(out)
}

/// A stack of experts must hold experts 0..n, each once, all of one shape.
fn check_stack(
    model: &ModelDesc,
    last: Option<&(Vec<usize>, String)>,
    experts: &[u32],
) -> Result<(), LayoutError> {
    let Some((parts, name)) = last else {
        return Ok(());
    };
    if !is_stack(name) {
        return Ok(());
    }
    let shape = &model.tensors[parts[0]].shape;
    let in_order = experts.iter().enumerate().all(|(k, &e)| e as usize == k);
    let same = parts.iter().all(|&i| &model.tensors[i].shape == shape) && shape.len() == 2;
    if in_order && same {
        Ok(())
    } else {
        let held: Vec<String> = parts
            .iter()
            .zip(experts)
            .map(|(&i, e)| format!("{e} {:?}", model.tensors[i].shape))
            .collect();
        Err(LayoutError::Unsupported(format!(
            "model.gguf: {name} stacks experts 0, 1, 2 ... of one 2-D shape; the archive \
             holds experts {}",
            held.join(", ")
        )))
    }
}

/// Whether the GGUF tensor `name` stacks experts (3-D even with one expert).
pub(super) fn is_stack(name: &str) -> bool {
    name.contains("_exps.")
}

/// Whether `model.gguf` serves tensor `index` transposed (GPT-2's `Conv1D` weights).
pub(super) fn is_transposed(model: &ModelDesc, index: usize) -> bool {
    let t = &model.tensors[index];
    // A GGUF source holds them as llama.cpp does already.
    model.gguf_meta.is_empty()
        && t.shape.len() == 2
        && names::transposed(model.arch.gguf_arch.as_deref().unwrap_or_default(), &t.name)
}

/// GGUF `ne` (fastest dimension first) of tensor `index` as `model.gguf` serves it.
pub(super) fn served_ne(model: &ModelDesc, index: usize) -> Vec<u64> {
    let shape = &model.tensors[index].shape;
    if is_transposed(model, index) {
        shape.clone()
    } else {
        shape.iter().rev().copied().collect()
    }
}

/// GGUF `ne` of the `model.gguf` tensor `name` made of `parts`: a stack of experts
/// adds the expert count as the slowest dimension.
pub(super) fn served_ne_of(model: &ModelDesc, parts: &[usize], name: &str) -> Vec<u64> {
    let mut ne = served_ne(model, parts[0]);
    if is_stack(name) {
        ne.push(parts.len() as u64);
    }
    ne
}

pub(super) fn build(
    model: &ModelDesc,
    plan: &GgufPlan,
    header: &HeaderFn<'_>,
) -> Result<VirtualFile, LayoutError> {
    let ft = view::file_type(plan, model);
    let tensors = &plan.tensors;
    let meta = if model.gguf_meta.is_empty() {
        derive_meta(model, ft)?
    } else {
        kept_meta(model, ft)
    };

    let mut meta = meta;
    if tensors.iter().any(|tv| tv.ty.block().0 > 1) {
        // What llama-quantize writes (GGML_QNT_VERSION) beside block-quantized data.
        meta.push(("general.quantization_version".into(), GgufValue::U32(2)));
    }
    let mut infos = Vec::new();
    for tv in tensors {
        infos.push((
            tv.gguf_name.clone(),
            served_ne_of(model, &tv.parts, &tv.gguf_name),
            tv.ty,
        ));
    }
    // Tensors llama.cpp's converter makes from config values (Phi-3's LongRoPE factors).
    let made = made_tensors(model)?;
    for (name, vals) in &made {
        infos.push((name.clone(), vec![vals.len() as u64], GgmlType::F32));
    }
    let out = header(meta, infos, ALIGNMENT)
        .map_err(|e| LayoutError::Unsupported(format!("model.gguf header: {e}")))?;
    if out.entries.len() != tensors.len() + made.len() {
        return Err(LayoutError::Metadata(
            "GGUF header lists a different number of tensors than asked".into(),
        ));
    }

    let mut b = Builder::default();
    b.bytes(out.bytes)?;
    let mut pos = 0u64;
    for (tv, &(offset, n_bytes)) in tensors.iter().zip(&out.entries) {
        let name = &model.tensors[tv.index].name;
        if offset < pos {
            return Err(LayoutError::Metadata(format!(
                "GGUF header places tensor {name} at {offset}, overlapping the previous one"
            )));
        }
        b.zeros(offset - pos)?;
        // A stack of experts is its experts' pieces back to back: whole rows each, so
        // ggml blocks never straddle two experts.
        let mut len = 0;
        for &index in &tv.parts {
            len += tensor_piece(&mut b, model, index, tv)?;
        }
        if len != n_bytes {
            return Err(LayoutError::Metadata(format!(
                "GGUF header gives tensor {} {n_bytes} bytes, its shape needs {len}",
                tv.gguf_name
            )));
        }
        pos = offset + len;
    }
    for ((name, vals), &(offset, n_bytes)) in made.iter().zip(&out.entries[tensors.len()..]) {
        let bytes: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        if offset < pos || n_bytes != bytes.len() as u64 {
            return Err(LayoutError::Metadata(format!(
                "GGUF header places tensor {name} at {offset}+{n_bytes}, not where it fits"
            )));
        }
        b.zeros(offset - pos)?;
        pos = offset + n_bytes;
        b.bytes(bytes)?;
    }
    if out.data_size < pos {
        return Err(LayoutError::Metadata(
            "GGUF header data size is smaller than its tensors".into(),
        ));
    }
    b.zeros(out.data_size - pos)?;
    Ok(b.finish("model.gguf"))
}

/// Model tensor `index` as (part of) `tv`, appended to `b`: its byte length.
fn tensor_piece(
    b: &mut Builder,
    model: &ModelDesc,
    index: usize,
    tv: &view::TensorView,
) -> Result<u64, LayoutError> {
    let t = &model.tensors[index];
    let name = &t.name;
    let permute = names::rope_permute_heads(
        model.arch.gguf_arch.as_deref(),
        name,
        model.arch.n_heads,
        model.arch.n_kv_heads,
    );
    let arch = model.arch.gguf_arch.as_deref().unwrap_or_default();
    // A GGUF source's values are llama.cpp's already.
    let shift = match model.gguf_meta.is_empty() {
        true => names::value_shift(arch, name),
        false => 0.0,
    };
    match shift {
        _ if is_transposed(model, index) => {
            b.tensor_transposed(name, index, (t.cols(), t.rows()), tv.ty)
        }
        0.0 => b.tensor(name, index, t.rows(), t.cols(), (tv.ty, tv.raw), permute),
        // A shifted tensor is a norm: encoded from its values, never copied.
        add => b.tensor_plus(name, index, (t.rows(), t.cols()), tv.ty, add),
    }
}

/// GGUF source metadata, verbatim but for the file type, the quantization version
/// (meaningless for float data) and the alignment (the header writer sets it).
fn kept_meta(model: &ModelDesc, file_type: u32) -> Vec<(String, GgufValue)> {
    let mut meta: Vec<(String, GgufValue)> = model
        .gguf_meta
        .iter()
        .filter(|(k, _)| k != "general.quantization_version" && k != "general.alignment")
        .cloned()
        .collect();
    let ft = GgufValue::U32(file_type);
    match meta.iter_mut().find(|(k, _)| k == "general.file_type") {
        Some((_, v)) => *v = ft,
        None => meta.push(("general.file_type".into(), ft)),
    }
    meta
}

/// Metadata of a Hugging Face source, as llama.cpp's converter would write it.
fn derive_meta(model: &ModelDesc, file_type: u32) -> Result<Vec<(String, GgufValue)>, LayoutError> {
    let a = &model.arch;
    let arch = super::gguf_arch(model)?.to_string();
    let config: Option<serde_json::Value> = model
        .hf_files
        .get("config.json")
        .and_then(|b| serde_json::from_slice(b).ok());
    let name = config
        .as_ref()
        .and_then(|c| c.get("_name_or_path"))
        .and_then(|v| v.as_str())
        .and_then(|s| s.trim_end_matches('/').rsplit('/').next())
        .filter(|s| !s.is_empty())
        .unwrap_or(&a.model_type)
        .to_string();
    if arch == "bert" || arch == "gpt2" {
        return layer_norm_meta(model, config.as_ref(), &name, file_type);
    }
    let s = |v: &str| GgufValue::String(v.to_string());
    let k = |suffix: &str| format!("{arch}.{suffix}");
    let mut m: Vec<(String, GgufValue)> = vec![
        ("general.architecture".into(), s(&arch)),
        ("general.type".into(), s("model")),
        ("general.name".into(), s(&name)),
        (k("block_count"), GgufValue::U32(a.n_layers)),
        (k("context_length"), GgufValue::U32(a.context_length)),
        (k("embedding_length"), GgufValue::U32(a.hidden_size)),
        (
            k("feed_forward_length"),
            GgufValue::U32(a.intermediate_size),
        ),
        (k("attention.head_count"), GgufValue::U32(a.n_heads)),
        (k("attention.head_count_kv"), GgufValue::U32(a.n_kv_heads)),
        (k("rope.freq_base"), GgufValue::F32(a.rope_theta)),
        (
            k("attention.layer_norm_rms_epsilon"),
            GgufValue::F32(a.rms_norm_eps),
        ),
    ];
    if a.n_heads > 0 && a.head_dim != a.hidden_size / a.n_heads {
        m.push((k("attention.key_length"), GgufValue::U32(a.head_dim)));
        m.push((k("attention.value_length"), GgufValue::U32(a.head_dim)));
    }
    m.push(("general.file_type".into(), GgufValue::U32(file_type)));
    m.push((k("vocab_size"), GgufValue::U32(a.vocab_size)));
    if let Some(c) = config.as_ref() {
        expert_meta(&mut m, c, &arch)?;
    }
    let mut rope_dims = a.head_dim;
    if arch == "phi3" {
        rope_dims = phi3_meta(&mut m, config.as_ref(), a)?;
    }
    if arch == "gemma2" {
        gemma2_meta(&mut m, config.as_ref());
    }
    m.push((k("rope.dimension_count"), GgufValue::U32(rope_dims)));
    m.extend(vocabulary(model, config.as_ref())?);
    Ok(m)
}

/// Mixture-of-experts keys, from config.json under the names llama.cpp's converter
/// looks for: the expert count and how many a token uses; Qwen2-MoE's expert and
/// shared-expert widths.
fn expert_meta(
    m: &mut Vec<(String, GgufValue)>,
    config: &serde_json::Value,
    arch: &str,
) -> Result<(), LayoutError> {
    let get = |keys: &[&str]| -> Result<Option<u32>, LayoutError> {
        let found = keys
            .iter()
            .find_map(|k| Some((*k, config.get(*k).filter(|v| !v.is_null())?)));
        let Some((key, v)) = found else {
            return Ok(None);
        };
        v.as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .map(Some)
            .ok_or_else(|| LayoutError::Metadata(format!("config.json: {key} is {v}, not a count")))
    };
    let k = |suffix: &str| format!("{arch}.{suffix}");
    let keys: [(&[&str], &str); 4] = [
        (
            &["num_local_experts", "num_experts", "n_routed_experts"],
            "expert_count",
        ),
        (
            &[
                "num_experts_per_tok",
                "num_experts_per_token",
                "top_k_experts",
            ],
            "expert_used_count",
        ),
        (&["moe_intermediate_size"], "expert_feed_forward_length"),
        (
            &["shared_expert_intermediate_size"],
            "expert_shared_feed_forward_length",
        ),
    ];
    for (names, key) in keys {
        // llama.cpp reads the expert widths for the Qwen MoE models only (its
        // converter writes them from Qwen2MoeModel, which Qwen3MoeModel extends).
        if key.starts_with("expert_")
            && key.contains("feed_forward")
            && arch != "qwen2moe"
            && arch != "qwen3moe"
        {
            continue;
        }
        if let Some(n) = get(names)? {
            m.push((k(key), GgufValue::U32(n)));
        }
    }
    Ok(())
}

/// Gemma 2's keys beyond the llama ones, from config.json as its converter reads them:
/// the soft-caps of attention logits and of the output, and the sliding window.
fn gemma2_meta(m: &mut Vec<(String, GgufValue)>, config: Option<&serde_json::Value>) {
    let get = |key: &str| config.and_then(|c| c.get(key));
    for (key, gguf) in [
        ("attn_logit_softcapping", "gemma2.attn_logit_softcapping"),
        ("final_logit_softcapping", "gemma2.final_logit_softcapping"),
    ] {
        if let Some(v) = get(key).and_then(serde_json::Value::as_f64) {
            m.push((gguf.into(), GgufValue::F32(v as f32)));
        }
    }
    if let Some(w) = get("sliding_window").and_then(serde_json::Value::as_u64) {
        m.push((
            "gemma2.attention.sliding_window".into(),
            GgufValue::U32(w.min(u32::MAX as u64) as u32),
        ));
    }
}

/// Phi-3's keys beyond the llama ones (the original context length and the sliding
/// window, 0 for none), as its converter writes them; returns the rotary dimension
/// count (`partial_rotary_factor` of a head). A LongRoPE model's attention factor too;
/// its factor tensors are [`made_tensors`].
fn phi3_meta(
    m: &mut Vec<(String, GgufValue)>,
    config: Option<&serde_json::Value>,
    a: &crate::model::ArchConfig,
) -> Result<u32, LayoutError> {
    let get = |key: &str| {
        config.and_then(|c| {
            c.get(key)
                .or_else(|| c.get("rope_scaling")?.get(key))
                .or_else(|| c.get("rope_parameters")?.get(key))
        })
    };
    let orig = get("original_max_position_embeddings")
        .and_then(serde_json::Value::as_u64)
        .map_or(a.context_length, |v| v.min(u32::MAX as u64) as u32);
    if let Some(attn) = phi3_long_rope(config, a)?.map(|l| l.attn_factor) {
        m.push((
            "phi3.rope.scaling.attn_factor".into(),
            GgufValue::F32(attn as f32),
        ));
    }
    let window = get("sliding_window")
        .and_then(serde_json::Value::as_u64)
        .unwrap_or(0)
        .min(u32::MAX as u64) as u32;
    m.push((
        "phi3.rope.scaling.original_context_length".into(),
        GgufValue::U32(orig),
    ));
    m.push((
        "phi3.attention.sliding_window".into(),
        GgufValue::U32(window),
    ));
    let pct = get("partial_rotary_factor")
        .and_then(serde_json::Value::as_f64)
        .unwrap_or(1.0);
    Ok(((pct * a.hidden_size as f64) as u32)
        .checked_div(a.n_heads)
        .unwrap_or(a.head_dim))
}

/// A Phi-3 LongRoPE configuration (Phi-3.5, the 128k Phi-3s), as llama.cpp's
/// converter turns it into GGUF: the long and short rotary factors become tensors
/// `rope_factors_long`/`rope_factors_short`, and the attention factor a key.
struct LongRope {
    long: Vec<f32>,
    short: Vec<f32>,
    attn_factor: f64,
}

/// The LongRoPE parameters of a Phi-3 config, None without `long_factor`; a config
/// the converter refuses (another scaling type, factor lists of the wrong length) means
/// no GGUF view, said in one line.
fn phi3_long_rope(
    config: Option<&serde_json::Value>,
    a: &crate::model::ArchConfig,
) -> Result<Option<LongRope>, LayoutError> {
    let get = |key: &str| {
        config.and_then(|c| {
            c.get(key)
                .or_else(|| c.get("rope_scaling")?.get(key))
                .or_else(|| c.get("rope_parameters")?.get(key))
        })
    };
    let Some(long) = get("long_factor").filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let no = |why: String| {
        Err(LayoutError::NoGguf(format!(
            "no model.gguf for this Phi-3: {why}"
        )))
    };
    let factors = |v: Option<&serde_json::Value>| -> Option<Vec<f32>> {
        v?.as_array()?
            .iter()
            .map(|x| x.as_f64().map(|f| f as f32))
            .collect()
    };
    let (Some(long), Some(short)) = (factors(Some(long)), factors(get("short_factor"))) else {
        return no("rope_scaling.long_factor and short_factor must be lists of numbers".into());
    };
    let pct = get("partial_rotary_factor")
        .and_then(serde_json::Value::as_f64)
        .unwrap_or(1.0);
    let rope_dims = ((pct * a.hidden_size as f64) as u32)
        .checked_div(a.n_heads)
        .unwrap_or(0) as usize;
    if long.len() != rope_dims / 2 || short.len() != rope_dims / 2 {
        return no(format!(
            "its LongRoPE factors have {} and {} values, not {} (half the rotary dimensions)",
            long.len(),
            short.len(),
            rope_dims / 2
        ));
    }
    let orig = get("original_max_position_embeddings")
        .and_then(serde_json::Value::as_f64)
        .unwrap_or(a.context_length as f64);
    let scale = a.context_length as f64 / orig;
    let kind = get("rope_type")
        .or_else(|| get("type"))
        .and_then(serde_json::Value::as_str)
        .unwrap_or("")
        .to_ascii_lowercase();
    let attn_factor = match kind.as_str() {
        _ if scale <= 1.0 => 1.0,
        "su" | "longrope" => (1.0 + scale.ln() / orig.ln()).sqrt(),
        "yarn" => 0.1 * scale.ln() + 1.0,
        other => {
            return no(format!(
                "rope scaling type {other:?} is not one llama.cpp runs"
            ))
        }
    };
    Ok(Some(LongRope {
        long,
        short,
        attn_factor,
    }))
}

/// The tensors `model.gguf` makes from config values rather than from the archive:
/// a Phi-3 LongRoPE model's two factor lists. (A GGUF source has them as tensors with
/// no Hugging Face name, so such a file does not import: one line says which.)
fn made_tensors(model: &ModelDesc) -> Result<Vec<(String, Vec<f32>)>, LayoutError> {
    if !model.gguf_meta.is_empty() || model.arch.gguf_arch.as_deref() != Some("phi3") {
        return Ok(Vec::new());
    }
    let config: Option<serde_json::Value> = model
        .hf_files
        .get("config.json")
        .and_then(|b| serde_json::from_slice(b).ok());
    Ok(match phi3_long_rope(config.as_ref(), &model.arch)? {
        Some(l) => vec![
            ("rope_factors_long.weight".into(), l.long),
            ("rope_factors_short.weight".into(), l.short),
        ],
        None => Vec::new(),
    })
}

/// Metadata of the LayerNorm architectures, BERT encoders and GPT-2, as llama.cpp's
/// converter writes it: no rotary keys, the LayerNorm epsilon, and for BERT
/// bidirectional attention and the pooling sentence-transformers' config names (what
/// llama-embedding pools by unless `--pooling` says otherwise); then the vocabulary
/// (WordPiece with its token-type count, or byte-level BPE).
fn layer_norm_meta(
    model: &ModelDesc,
    config: Option<&serde_json::Value>,
    name: &str,
    file_type: u32,
) -> Result<Vec<(String, GgufValue)>, LayoutError> {
    let a = &model.arch;
    let arch = super::gguf_arch(model)?;
    let (eps_key, eps_default) = match arch {
        "gpt2" => ("layer_norm_epsilon", 1e-5),
        _ => ("layer_norm_eps", 1e-12),
    };
    let eps = config
        .and_then(|c| c.get(eps_key))
        .and_then(serde_json::Value::as_f64)
        .unwrap_or(eps_default) as f32;
    let s = |v: &str| GgufValue::String(v.to_string());
    let k = |suffix: &str| format!("{arch}.{suffix}");
    let mut m: Vec<(String, GgufValue)> = vec![
        ("general.architecture".into(), s(arch)),
        ("general.type".into(), s("model")),
        ("general.name".into(), s(name)),
        (k("block_count"), GgufValue::U32(a.n_layers)),
        (k("context_length"), GgufValue::U32(a.context_length)),
        (k("embedding_length"), GgufValue::U32(a.hidden_size)),
        (
            k("feed_forward_length"),
            GgufValue::U32(a.intermediate_size),
        ),
        (k("attention.head_count"), GgufValue::U32(a.n_heads)),
        (k("attention.layer_norm_epsilon"), GgufValue::F32(eps)),
    ];
    if arch == "bert" {
        m.push(("bert.attention.causal".into(), GgufValue::Bool(false)));
        if let Some(p) = pooling_type(model)? {
            m.push(("bert.pooling_type".into(), GgufValue::U32(p)));
        }
    }
    m.push(("general.file_type".into(), GgufValue::U32(file_type)));
    m.extend(vocabulary(model, config)?);
    Ok(m)
}

/// llama.cpp's pooling type (1 mean, 2 CLS, 3 last token) of a sentence-transformers
/// model, as its converter reads it: the config of the module `modules.json` lists
/// as a Pooling; None without one. A pooling llama.cpp has no type for (max, weighted
/// mean ...) means no GGUF view, as the converter refuses it.
fn pooling_type(model: &ModelDesc) -> Result<Option<u32>, LayoutError> {
    let json = |name: &str| -> Option<serde_json::Value> {
        serde_json::from_slice(model.hf_files.get(name)?).ok()
    };
    let Some(modules) = json("modules.json") else {
        return Ok(None);
    };
    let path = modules.as_array().into_iter().flatten().find_map(|m| {
        m.get("type")?
            .as_str()?
            .ends_with("Pooling")
            .then(|| m.get("path")?.as_str())
            .flatten()
    });
    let Some(config) = path.and_then(|p| json(&format!("{p}/config.json"))) else {
        return Ok(None);
    };
    let on = |key: &str| config.get(key).and_then(serde_json::Value::as_bool) == Some(true);
    let mode = config
        .get("pooling_mode")
        .and_then(serde_json::Value::as_str);
    Ok(Some(
        if on("pooling_mode_mean_tokens") || mode == Some("mean") {
            1
        } else if on("pooling_mode_cls_token") || mode == Some("cls") {
            2
        } else if on("pooling_mode_lasttoken") || mode == Some("lasttoken") {
            3
        } else {
            return Err(LayoutError::NoGguf(format!(
            "no model.gguf: the sentence-transformers pooling in {}/config.json has no llama.cpp pooling type (mean, CLS and last token have)",
            path.unwrap_or_default()
        )));
        },
    ))
}

/// The GGUF vocabulary of a Hugging Face source. A tokenizer it cannot write (a
/// SentencePiece one) means no GGUF view: llama.cpp cannot run a model without its
/// vocabulary, and the mount still serves the other views.
fn vocabulary(
    model: &ModelDesc,
    config: Option<&serde_json::Value>,
) -> Result<Vec<(String, GgufValue)>, LayoutError> {
    tokenizer::gguf_tokenizer_meta(model, config).map_err(|e| match e {
        LayoutError::Unsupported(why) => LayoutError::NoGguf(format!("no model.gguf: {why}")),
        e => e,
    })
}

/// The `tokenizer.ggml.pre` name llama.cpp uses for a `tokenizer.json` pre-tokenizer,
/// recognized by structure: SmolLM's Digits+ByteLevel, Llama 3's and Qwen2's split
/// regexes, plain GPT-2 ByteLevel; "default" otherwise.
pub fn gguf_pre_tokenizer_name(pre_tokenizer: &serde_json::Value) -> &'static str {
    tokenizer::pre_name(pre_tokenizer)
}
