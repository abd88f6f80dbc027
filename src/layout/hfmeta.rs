//! Hugging Face side files: verbatim from a Hugging Face source; for a GGUF source,
//! `config.json` and `generation_config.json` derived from the architecture config and
//! `tokenizer.json` / `tokenizer_config.json` from the GGUF vocabulary.

use serde_json::{json, Value};

use crate::gguf::{meta_get, GgufValue};
use crate::model::{FloatType, ModelDesc};

use super::{tokenizer, LayoutError};

/// An f32 as the decimal a person wrote (1e-05, not 9.999999747378752e-06).
fn f32_json(v: f32) -> Value {
    format!("{v}")
        .parse::<f64>()
        .ok()
        .and_then(serde_json::Number::from_f64)
        .map_or(Value::Null, Value::Number)
}

fn pretty(v: &Value) -> Result<Vec<u8>, LayoutError> {
    let mut b = serde_json::to_vec_pretty(v)
        .map_err(|e| LayoutError::Metadata(format!("serializing JSON: {e}")))?;
    b.push(b'\n');
    Ok(b)
}

/// The safetensors view's default dtype, named as `torch_dtype`.
fn torch_dtype(model: &ModelDesc) -> &'static str {
    let ft = model
        .tensors
        .iter()
        .filter_map(|t| Some((t.shape.len(), t.source.float_view()?)))
        .find(|(dims, _)| *dims >= 2)
        .or_else(|| {
            model
                .tensors
                .iter()
                .find_map(|t| Some((1, t.source.float_view()?)))
        })
        .map_or(FloatType::F16, |(_, f)| f);
    match ft {
        FloatType::F32 => "float32",
        FloatType::F16 => "float16",
        FloatType::BF16 => "bfloat16",
    }
}

/// A GGUF source's `{arch}.{key}` metadata value.
fn gguf_key<'a>(model: &'a ModelDesc, key: &str) -> Option<&'a GgufValue> {
    let arch = model.arch.gguf_arch.as_deref()?;
    meta_get(&model.gguf_meta, &format!("{arch}.{key}"))
}

/// How many experts a token uses: `num_experts_per_tok` (or its other names) of a
/// Hugging Face source's config.json, `{arch}.expert_used_count` of a GGUF source.
pub(super) fn experts_per_token(model: &ModelDesc) -> Option<u32> {
    let from_config = model
        .hf_files
        .get("config.json")
        .and_then(|b| serde_json::from_slice::<Value>(b).ok())
        .and_then(|c| {
            [
                "num_experts_per_tok",
                "num_experts_per_token",
                "top_k_experts",
            ]
            .iter()
            .find_map(|k| c.get(*k)?.as_u64())
        });
    from_config
        .or_else(|| gguf_key(model, "expert_used_count")?.as_u64())
        .and_then(|n| u32::try_from(n).ok())
}

/// GPT-2's config.json, in its own key names.
fn gpt2_config(model: &ModelDesc) -> Value {
    let a = &model.arch;
    json!({
        "activation_function": "gelu_new",
        "architectures": ["GPT2LMHeadModel"],
        "attn_pdrop": 0.0,
        "bos_token_id": a.bos_token_id,
        "embd_pdrop": 0.0,
        "eos_token_id": a.eos_token_id,
        "initializer_range": 0.02,
        "layer_norm_epsilon": f32_json(a.rms_norm_eps),
        "model_type": "gpt2",
        "n_embd": a.hidden_size,
        "n_head": a.n_heads,
        "n_inner": (a.intermediate_size != 4 * a.hidden_size).then_some(a.intermediate_size),
        "n_layer": a.n_layers,
        "n_positions": a.context_length,
        "resid_pdrop": 0.0,
        "tie_word_embeddings": a.tie_word_embeddings,
        "torch_dtype": torch_dtype(model),
        "use_cache": true,
        "vocab_size": a.vocab_size,
    })
}

/// A BERT encoder's config.json (`AutoModel` loads it as `BertModel`; llama.cpp's GGUF
/// has no pooler, so transformers makes a fresh one, which the hidden states ignore).
fn bert_config(model: &ModelDesc) -> Value {
    let a = &model.arch;
    let type_vocab = model
        .tensors
        .iter()
        .find(|t| t.name == "embeddings.token_type_embeddings.weight")
        .map_or(2, |t| t.rows());
    let pad = meta_get(&model.gguf_meta, "tokenizer.ggml.padding_token_id")
        .and_then(GgufValue::as_u64)
        .unwrap_or(0);
    json!({
        "architectures": ["BertModel"],
        "attention_probs_dropout_prob": 0.1,
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.1,
        "hidden_size": a.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": a.intermediate_size,
        "layer_norm_eps": f32_json(a.rms_norm_eps),
        "max_position_embeddings": a.context_length,
        "model_type": "bert",
        "num_attention_heads": a.n_heads,
        "num_hidden_layers": a.n_layers,
        "pad_token_id": pad,
        "position_embedding_type": "absolute",
        "torch_dtype": torch_dtype(model),
        "type_vocab_size": type_vocab,
        "use_cache": true,
        "vocab_size": a.vocab_size,
    })
}

fn config_json(model: &ModelDesc) -> Result<Value, LayoutError> {
    let a = &model.arch;
    let (arch_class, bias) = match a.model_type.as_str() {
        "llama" => ("LlamaForCausalLM", false),
        "mistral" => ("MistralForCausalLM", false),
        "qwen2" => ("Qwen2ForCausalLM", true),
        "qwen3" => ("Qwen3ForCausalLM", false),
        "phi3" => ("Phi3ForCausalLM", false),
        "gemma2" => ("Gemma2ForCausalLM", false),
        "mixtral" => ("MixtralForCausalLM", false),
        "qwen2_moe" => ("Qwen2MoeForCausalLM", true),
        "qwen3_moe" => ("Qwen3MoeForCausalLM", false),
        "olmoe" => ("OlmoeForCausalLM", false),
        "gpt2" => return Ok(gpt2_config(model)),
        "bert" => return Ok(bert_config(model)),
        other => {
            return Err(LayoutError::Unsupported(format!(
                "config.json for model type {other:?}: only llama, mistral, qwen2, qwen3, phi3, gemma2, gpt2, bert, mixtral, qwen2_moe, qwen3_moe and olmoe are supported"
            )))
        }
    };
    let mut c = serde_json::Map::new();
    c.insert("architectures".into(), json!([arch_class]));
    // Qwen2's and Qwen2-MoE's Q/K/V biases are not a config key.
    if a.model_type != "qwen2" && a.model_type != "qwen2_moe" {
        c.insert("attention_bias".into(), json!(bias));
    }
    c.insert("attention_dropout".into(), json!(0.0));
    c.insert("bos_token_id".into(), json!(a.bos_token_id));
    c.insert("eos_token_id".into(), json!(a.eos_token_id));
    c.insert("head_dim".into(), json!(a.head_dim));
    match a.model_type.as_str() {
        // llama.cpp's Gemma 2 scales queries by the head size (all but the 27B model)
        // and keeps the soft-caps and the window as keys.
        "gemma2" => {
            c.insert("hidden_activation".into(), json!("gelu_pytorch_tanh"));
            c.insert("query_pre_attn_scalar".into(), json!(a.head_dim));
            for key in ["attn_logit_softcapping", "final_logit_softcapping"] {
                let v = gguf_key(model, key).and_then(GgufValue::as_f64);
                c.insert(key.into(), v.map_or(Value::Null, |v| f32_json(v as f32)));
            }
            let w = gguf_key(model, "attention.sliding_window").and_then(GgufValue::as_u64);
            c.insert("sliding_window".into(), json!(w));
        }
        _ => {
            c.insert("hidden_act".into(), json!("silu"));
        }
    }
    if a.model_type == "phi3" {
        // Rotary dimensions as a share of a head; the original context; the window
        // (0: none).
        let rot = gguf_key(model, "rope.dimension_count")
            .and_then(GgufValue::as_u64)
            .map_or(1.0, |d| d as f64 / a.head_dim.max(1) as f64);
        c.insert("partial_rotary_factor".into(), json!(rot));
        let orig = gguf_key(model, "rope.scaling.original_context_length")
            .and_then(GgufValue::as_u64)
            .unwrap_or(a.context_length as u64);
        c.insert("original_max_position_embeddings".into(), json!(orig));
        let w = gguf_key(model, "attention.sliding_window")
            .and_then(GgufValue::as_u64)
            .filter(|&w| w > 0);
        c.insert("sliding_window".into(), json!(w));
    }
    c.insert("hidden_size".into(), json!(a.hidden_size));
    c.insert("initializer_range".into(), json!(0.02));
    c.insert("intermediate_size".into(), json!(a.intermediate_size));
    c.insert("max_position_embeddings".into(), json!(a.context_length));
    if a.model_type == "llama" {
        c.insert("mlp_bias".into(), json!(false));
    }
    c.insert("model_type".into(), json!(a.model_type));
    c.insert("num_attention_heads".into(), json!(a.n_heads));
    c.insert("num_hidden_layers".into(), json!(a.n_layers));
    c.insert("num_key_value_heads".into(), json!(a.n_kv_heads));
    if let Some(p) = a.pad_token_id {
        c.insert("pad_token_id".into(), json!(p));
    }
    c.insert("rms_norm_eps".into(), f32_json(a.rms_norm_eps));
    c.insert("rope_scaling".into(), Value::Null);
    c.insert("rope_theta".into(), f32_json(a.rope_theta));
    c.insert("tie_word_embeddings".into(), json!(a.tie_word_embeddings));
    c.insert("torch_dtype".into(), json!(torch_dtype(model)));
    if a.model_type == "qwen2" || a.model_type == "qwen2_moe" {
        c.insert("use_sliding_window".into(), json!(false));
    }
    moe_config(model, &mut c)?;
    c.insert("use_cache".into(), json!(true));
    c.insert("vocab_size".into(), json!(a.vocab_size));
    Ok(Value::Object(c))
}

/// A mixture of experts' keys, from the GGUF expert keys under transformers' names;
/// routing as llama.cpp runs it (Mixtral and Qwen3-MoE renormalize the chosen experts'
/// weights, Qwen2-MoE and OLMoE do not).
fn moe_config(
    model: &ModelDesc,
    c: &mut serde_json::Map<String, Value>,
) -> Result<(), LayoutError> {
    let a = &model.arch;
    let count = |key: &str| -> Result<u64, LayoutError> {
        gguf_key(model, key)
            .and_then(GgufValue::as_u64)
            .ok_or_else(|| {
                LayoutError::Metadata(format!("config.json: no {key} in the GGUF source"))
            })
    };
    let experts = match a.model_type.as_str() {
        "mixtral" => "num_local_experts",
        "qwen2_moe" | "qwen3_moe" | "olmoe" => "num_experts",
        _ => return Ok(()),
    };
    c.insert(experts.into(), json!(count("expert_count")?));
    c.insert(
        "num_experts_per_tok".into(),
        json!(count("expert_used_count")?),
    );
    if a.model_type == "qwen2_moe" || a.model_type == "qwen3_moe" {
        let ff = count("expert_feed_forward_length")?;
        c.insert("moe_intermediate_size".into(), json!(ff));
        if a.model_type == "qwen2_moe" {
            let shared = gguf_key(model, "expert_shared_feed_forward_length")
                .and_then(GgufValue::as_u64)
                .unwrap_or(0);
            c.insert("shared_expert_intermediate_size".into(), json!(shared));
        }
        c.insert("decoder_sparse_step".into(), json!(1));
        c.insert("mlp_only_layers".into(), json!([]));
    }
    match a.model_type.as_str() {
        "mixtral" => {}
        "qwen3_moe" => {
            c.insert("norm_topk_prob".into(), json!(true));
        }
        _ => {
            c.insert("norm_topk_prob".into(), json!(false));
        }
    }
    Ok(())
}

pub(super) fn build(model: &ModelDesc) -> Result<Vec<(String, Vec<u8>)>, LayoutError> {
    if !model.hf_files.is_empty() {
        // Names come from archive metadata: one checked here is safe to serve and to
        // write under an export directory.
        for name in model.hf_files.keys() {
            crate::model::check_hf_file_name(name).map_err(LayoutError::Metadata)?;
        }
        // BTreeMap iteration is sorted by name.
        return Ok(model
            .hf_files
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect());
    }
    let a = &model.arch;
    let mut files = vec![("config.json".to_string(), pretty(&config_json(model)?)?)];

    let mut gen = serde_json::Map::new();
    gen.insert("_from_model_config".into(), json!(true));
    if let Some(b) = a.bos_token_id {
        gen.insert("bos_token_id".into(), json!(b));
    }
    if let Some(e) = a.eos_token_id {
        gen.insert("eos_token_id".into(), json!(e));
    }
    if let Some(p) = a.pad_token_id {
        gen.insert("pad_token_id".into(), json!(p));
    }
    files.push((
        "generation_config.json".to_string(),
        pretty(&Value::Object(gen))?,
    ));

    let has_vocab = meta_get(&model.gguf_meta, "tokenizer.ggml.model")
        .and_then(GgufValue::as_str)
        .is_some();
    if has_vocab {
        let t0 = std::time::Instant::now();
        let made = tokenizer::hf_tokenizer(&model.gguf_meta, a.context_length);
        tracing::debug!(
            "tokenizer.json derived from the GGUF vocabulary in {:?}",
            t0.elapsed()
        );
        match made {
            Ok(t) => {
                files.push(("tokenizer.json".to_string(), t.tokenizer_json));
                files.push((
                    "tokenizer_config.json".to_string(),
                    pretty(&t.tokenizer_config)?,
                ));
            }
            // The weights and config stay usable without a tokenizer; say why it is absent.
            Err(LayoutError::Unsupported(why)) => {
                tracing::warn!("no tokenizer.json for this model: {why}");
            }
            Err(e) => return Err(e),
        }
    }
    files.sort_by(|x, y| x.0.cmp(&y.0));
    Ok(files)
}
