//! Fixtures shared by the unit tests: a tiny architecture, tensor descriptions, an
//! in-memory source model and a word-level tokenizer. Each test module starts from
//! these and overrides only the fields its checks depend on (struct update syntax), so
//! a new `ArchConfig` field is added here once rather than in every module.

use std::collections::BTreeMap;

use crate::archive::Store;
use crate::import::{ImportError, SourceModel};
use crate::model::{ArchConfig, ModelDesc, ReadError, SourceType, TensorDesc};

/// A one-layer llama: hidden 4, 2 heads of 2 sharing one KV head, vocabulary 10.
pub(crate) fn tiny_arch() -> ArchConfig {
    ArchConfig {
        model_type: "llama".into(),
        gguf_arch: Some("llama".into()),
        n_layers: 1,
        hidden_size: 4,
        intermediate_size: 8,
        n_heads: 2,
        n_kv_heads: 1,
        head_dim: 2,
        vocab_size: 10,
        context_length: 64,
        rope_theta: 10000.0,
        rms_norm_eps: 1e-5,
        tie_word_embeddings: false,
        bos_token_id: Some(1),
        eos_token_id: Some(2),
        pad_token_id: None,
    }
}

pub(crate) fn tensor(name: &str, shape: &[u64], source: SourceType) -> TensorDesc {
    TensorDesc {
        name: name.into(),
        shape: shape.to_vec(),
        source,
    }
}

pub(crate) fn f32_tensor(name: &str, shape: &[u64]) -> TensorDesc {
    tensor(name, shape, SourceType::F32)
}

/// A model description with no HF files and no GGUF metadata.
pub(crate) fn model(arch: ArchConfig, tensors: Vec<TensorDesc>) -> ModelDesc {
    ModelDesc {
        arch,
        tensors,
        hf_files: BTreeMap::new(),
        gguf_meta: Vec::new(),
    }
}

/// An in-memory [`SourceModel`]: a model description and each tensor's values as f32
/// (its raw bytes are those values little-endian).
pub(crate) struct MemSource {
    pub desc: ModelDesc,
    pub data: Vec<Vec<f32>>,
}

impl SourceModel for MemSource {
    fn desc(&self) -> &ModelDesc {
        &self.desc
    }
    fn raw(&self, i: usize) -> Result<Vec<u8>, ImportError> {
        Ok(self.data[i].iter().flat_map(|x| x.to_le_bytes()).collect())
    }
    fn f32(&self, i: usize) -> Result<Vec<f32>, ImportError> {
        Ok(self.data[i].clone())
    }
}

/// `tokenizer.json` of a word-level tokenizer over `words` (ids = positions, the first
/// word is the unknown token), split on whitespace.
pub(crate) fn word_level_tokenizer(words: &[&str]) -> Vec<u8> {
    let vocab: serde_json::Map<String, serde_json::Value> = words
        .iter()
        .enumerate()
        .map(|(i, w)| (w.to_string(), serde_json::json!(i)))
        .collect();
    serde_json::to_vec(&serde_json::json!({
        "version": "1.0",
        "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": words[0]}
    }))
    .unwrap()
}

/// All rows of tensor `i`, reconstructed by the archive.
pub(crate) fn read_all(a: &dyn Store, i: usize) -> Result<Vec<f32>, ReadError> {
    let t = &a.model().tensors[i];
    let mut out = vec![0f32; t.numel() as usize];
    a.read_rows(i, 0, t.rows(), &mut out)?;
    Ok(out)
}
