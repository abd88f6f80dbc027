//! A tiny llama-shaped Hugging Face model (hidden 32, 2 layers, vocabulary 100, a
//! byte-level BPE tokenizer), small enough that every archive converted from it is a
//! good AFL seed (AFL wants inputs of kilobytes, not the megabytes of the test model).
//! The seed generator converts it with the real converters; the `safetensors` and
//! `hf_json` targets use its files as the fixed part of their directories.

use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde_json::{json, Value};

pub const HIDDEN: usize = 32;
pub const FFN: usize = 64;
pub const LAYERS: usize = 2;
pub const HEADS: usize = 4;
pub const KV_HEADS: usize = 2;
/// 3 special tokens, 94 printable ASCII characters, `Ġ`, and 2 merges.
pub const VOCAB: usize = 100;

/// A small deterministic generator (xorshift), so seeds are reproducible.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
    /// Uniform in [-0.1, 0.1).
    pub fn weight(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.2
    }
}

/// (HF name, shape) of every tensor, embeddings first.
pub fn tensor_shapes() -> Vec<(String, Vec<usize>)> {
    let mut v = vec![
        ("model.embed_tokens.weight".to_string(), vec![VOCAB, HIDDEN]),
        ("model.norm.weight".to_string(), vec![HIDDEN]),
    ];
    let kv = HIDDEN / HEADS * KV_HEADS;
    for l in 0..LAYERS {
        let p = format!("model.layers.{l}.");
        v.push((format!("{p}input_layernorm.weight"), vec![HIDDEN]));
        v.push((format!("{p}post_attention_layernorm.weight"), vec![HIDDEN]));
        v.push((format!("{p}self_attn.q_proj.weight"), vec![HIDDEN, HIDDEN]));
        v.push((format!("{p}self_attn.k_proj.weight"), vec![kv, HIDDEN]));
        v.push((format!("{p}self_attn.v_proj.weight"), vec![kv, HIDDEN]));
        v.push((format!("{p}self_attn.o_proj.weight"), vec![HIDDEN, HIDDEN]));
        v.push((format!("{p}mlp.gate_proj.weight"), vec![FFN, HIDDEN]));
        v.push((format!("{p}mlp.up_proj.weight"), vec![FFN, HIDDEN]));
        v.push((format!("{p}mlp.down_proj.weight"), vec![HIDDEN, FFN]));
    }
    v
}

/// `model.safetensors`: every tensor f16 with seeded random values.
pub fn safetensors_bytes() -> Vec<u8> {
    let mut rng = Rng::new(42);
    let data: Vec<(String, Vec<usize>, Vec<u8>)> = tensor_shapes()
        .into_iter()
        .map(|(name, shape)| {
            let n: usize = shape.iter().product();
            let bytes = (0..n)
                .flat_map(|_| half::f16::from_f32(rng.weight()).to_le_bytes())
                .collect();
            (name, shape, bytes)
        })
        .collect();
    let views: Vec<(String, TensorView)> = data
        .iter()
        .map(|(n, s, d)| {
            (
                n.clone(),
                TensorView::new(Dtype::F16, s.clone(), d).unwrap(),
            )
        })
        .collect();
    safetensors::serialize(views, None).unwrap()
}

pub fn config_json() -> Value {
    json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": HIDDEN, "intermediate_size": FFN, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "vocab_size": VOCAB,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": true, "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": "float16",
    })
}

/// A byte-level BPE `tokenizer.json` in the form Hugging Face writes (SmolLM2's
/// pre-tokenizer and special tokens, a 100-token vocabulary).
pub fn tokenizer_json() -> Value {
    let special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
    let mut vocab = serde_json::Map::new();
    for (i, s) in special.iter().enumerate() {
        vocab.insert(s.to_string(), json!(i));
    }
    for c in b'!'..=b'~' {
        let id = vocab.len();
        vocab.insert((c as char).to_string(), json!(id));
    }
    for tok in ["Ġ", "Ġt", "he"] {
        let id = vocab.len();
        vocab.insert(tok.to_string(), json!(id));
    }
    assert_eq!(vocab.len(), VOCAB);
    let added: Vec<Value> = special
        .iter()
        .enumerate()
        .map(|(i, s)| {
            json!({"id": i, "content": s, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let byte_level = |prefix: bool| {
        json!({"type": "ByteLevel", "add_prefix_space": prefix, "trim_offsets": true,
               "use_regex": true})
    };
    json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true},
            byte_level(false)]},
        "post_processor": byte_level(false),
        "decoder": byte_level(true),
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": [["Ġ", "t"], ["h", "e"]]},
    })
}

pub fn tokenizer_config_json() -> Value {
    json!({
        "add_prefix_space": false, "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
        "pad_token": "<|im_end|>", "unk_token": "<|endoftext|>",
        "model_max_length": 256, "tokenizer_class": "GPT2Tokenizer",
        "chat_template": "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}",
    })
}

pub fn generation_config_json() -> Value {
    json!({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "temperature": 0.7})
}

/// The small JSON files of the directory, name and bytes.
pub fn json_files() -> Vec<(String, Vec<u8>)> {
    [
        ("config.json", config_json()),
        ("generation_config.json", generation_config_json()),
        ("tokenizer.json", tokenizer_json()),
        ("tokenizer_config.json", tokenizer_config_json()),
    ]
    .into_iter()
    .map(|(n, v)| (n.to_string(), serde_json::to_vec_pretty(&v).unwrap()))
    .collect()
}

/// Write the whole Hugging Face directory.
pub fn write_hf_dir(dir: &std::path::Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    for (name, bytes) in json_files() {
        std::fs::write(dir.join(name), bytes)?;
    }
    std::fs::write(dir.join("model.safetensors"), safetensors_bytes())
}
