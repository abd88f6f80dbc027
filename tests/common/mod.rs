//! What several integration tests share: a tiny llama-shaped Hugging Face model with
//! seeded random weights (no downloads).
#![allow(dead_code)]

use std::path::Path;

use rand::{RngExt, SeedableRng};
use safetensors::tensor::TensorView;
use safetensors::Dtype;

/// Sizes of the tiny model.
#[derive(Clone, Copy)]
pub struct Dims {
    pub hidden: usize,
    pub ffn: usize,
    pub vocab: usize,
    pub layers: usize,
}

/// A tiny llama-shaped model with random (seeded) weights, written as a HF directory.
pub fn write_tiny_hf(dir: &Path, d: Dims) {
    let (hidden, ffn, vocab, layers) = (d.hidden, d.ffn, d.vocab, d.layers);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(42);
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    let mut add = |name: String, shape: Vec<usize>, rng: &mut rand_chacha::ChaCha8Rng| {
        let n: usize = shape.iter().product();
        let vals: Vec<u8> = (0..n)
            .flat_map(|_| half::f16::from_f32(rng.random_range(-0.1f32..0.1)).to_le_bytes())
            .collect();
        tensors.push((name, shape, vals));
    };
    add(
        "model.embed_tokens.weight".into(),
        vec![vocab, hidden],
        &mut rng,
    );
    add("model.norm.weight".into(), vec![hidden], &mut rng);
    for l in 0..layers {
        let p = format!("model.layers.{l}.");
        add(format!("{p}input_layernorm.weight"), vec![hidden], &mut rng);
        add(
            format!("{p}post_attention_layernorm.weight"),
            vec![hidden],
            &mut rng,
        );
        add(
            format!("{p}self_attn.q_proj.weight"),
            vec![hidden, hidden],
            &mut rng,
        );
        add(
            format!("{p}self_attn.k_proj.weight"),
            vec![hidden / 2, hidden],
            &mut rng,
        );
        add(
            format!("{p}self_attn.v_proj.weight"),
            vec![hidden / 2, hidden],
            &mut rng,
        );
        add(
            format!("{p}self_attn.o_proj.weight"),
            vec![hidden, hidden],
            &mut rng,
        );
        add(
            format!("{p}mlp.gate_proj.weight"),
            vec![ffn, hidden],
            &mut rng,
        );
        add(
            format!("{p}mlp.up_proj.weight"),
            vec![ffn, hidden],
            &mut rng,
        );
        add(
            format!("{p}mlp.down_proj.weight"),
            vec![hidden, ffn],
            &mut rng,
        );
    }
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(n, s, d)| {
            (
                n.clone(),
                TensorView::new(Dtype::F16, s.clone(), d).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": layers,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": vocab,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": true, "bos_token_id": 1, "eos_token_id": 2,
    });
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_vec(&config).unwrap(),
    )
    .unwrap();
}
