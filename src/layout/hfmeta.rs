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

fn config_json(model: &ModelDesc) -> Result<Value, LayoutError> {
    let a = &model.arch;
    let (arch_class, bias) = match a.model_type.as_str() {
        "llama" => ("LlamaForCausalLM", false),
        "mistral" => ("MistralForCausalLM", false),
        "qwen2" => ("Qwen2ForCausalLM", true),
        "qwen3" => ("Qwen3ForCausalLM", false),
        other => {
            return Err(LayoutError::Unsupported(format!(
                "config.json for model type {other:?}: only llama, mistral, qwen2 and qwen3 are supported"
            )))
        }
    };
    let mut c = serde_json::Map::new();
    c.insert("architectures".into(), json!([arch_class]));
    if a.model_type != "qwen2" {
        c.insert("attention_bias".into(), json!(bias));
    }
    c.insert("attention_dropout".into(), json!(0.0));
    c.insert("bos_token_id".into(), json!(a.bos_token_id));
    c.insert("eos_token_id".into(), json!(a.eos_token_id));
    c.insert("head_dim".into(), json!(a.head_dim));
    c.insert("hidden_act".into(), json!("silu"));
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
    if a.model_type == "qwen2" {
        c.insert("use_sliding_window".into(), json!(false));
    }
    c.insert("use_cache".into(), json!(true));
    c.insert("vocab_size".into(), json!(a.vocab_size));
    Ok(Value::Object(c))
}

pub(super) fn build(model: &ModelDesc) -> Result<Vec<(String, Vec<u8>)>, LayoutError> {
    if !model.hf_files.is_empty() {
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
