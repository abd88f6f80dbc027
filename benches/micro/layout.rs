//! Throughput of export-sized (8 MiB) reads of the virtual safetensors and GGUF files
//! over an in-memory row source: layout and dtype conversion, no decoding.

use std::collections::BTreeMap;

use cawsfs::gguf::GgmlType;
use cawsfs::layout::{gguf_file, gguf_plan, safetensors_file, GgufView};
use cawsfs::model::{
    ArchConfig, FloatType, ModelDesc, ReadError, RowSource, SourceType, TensorDesc,
};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Random row-major values and the column count of each tensor.
struct Mem(Vec<(Vec<f32>, u64)>);

impl Mem {
    fn new(model: &ModelDesc, seed: u64) -> Mem {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let data = model
            .tensors
            .iter()
            .map(|t| {
                let v = (0..t.numel())
                    .map(|_| (rng.random::<f32>() - 0.5) * 3.0)
                    .collect();
                (v, t.cols())
            })
            .collect();
        Mem(data)
    }
}

impl RowSource for Mem {
    fn read_rows(&self, tensor: usize, r0: u64, r1: u64, out: &mut [f32]) -> Result<(), ReadError> {
        let (v, c) = &self.0[tensor];
        out.copy_from_slice(&v[(r0 * c) as usize..(r1 * c) as usize]);
        Ok(())
    }
}

/// The layout tests' architecture (with 16 heads) and two f32 matrices of real size.
fn model() -> ModelDesc {
    let f32_tensor = |name: &str, shape: &[u64]| TensorDesc {
        name: name.into(),
        shape: shape.to_vec(),
        source: SourceType::F32,
    };
    ModelDesc {
        arch: ArchConfig {
            model_type: "llama".into(),
            gguf_arch: Some("llama".into()),
            n_layers: 2,
            hidden_size: 64,
            intermediate_size: 96,
            n_heads: 16,
            n_kv_heads: 2,
            head_dim: 16,
            vocab_size: 100,
            context_length: 2048,
            rope_theta: 10000.0,
            rms_norm_eps: 1e-5,
            tie_word_embeddings: false,
            bos_token_id: Some(1),
            eos_token_id: Some(2),
            pad_token_id: None,
        },
        tensors: vec![
            f32_tensor("model.embed_tokens.weight", &[16384, 2048]),
            f32_tensor("model.layers.0.self_attn.q_proj.weight", &[2048, 2048]),
        ],
        hf_files: BTreeMap::new(),
        gguf_meta: Vec::new(),
    }
}

pub fn export_throughput() {
    let model = model();
    let src = Mem::new(&model, 9);
    for f in [
        safetensors_file(&model, Some(FloatType::F16)).unwrap(),
        gguf_file(
            &model,
            &gguf_plan(&model, GgufView::Type(GgmlType::F16), &[]).unwrap(),
        )
        .unwrap(),
    ] {
        let mut buf = vec![0u8; 8 << 20];
        let t = std::time::Instant::now();
        let mut off = 0;
        while off < f.size {
            off += f.read_at(&src, off, &mut buf).unwrap() as u64;
        }
        let s = t.elapsed().as_secs_f64();
        println!(
            "{}: {:.0} MiB in {s:.3}s = {:.2} GB/s",
            f.name,
            f.size as f64 / 1048576.0,
            f.size as f64 / s / 1e9
        );
    }
}
