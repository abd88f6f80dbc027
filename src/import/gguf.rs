//! GGUF importer: a llama.cpp GGUF file (architectures `llama` (Mixtral too),
//! `qwen2`, `qwen3`, `qwen2moe`, `qwen3moe`, `olmoe`, `phi3`, `gemma2`, `gpt2` and `bert`) seen as
//! a [`ModelDesc`] in Hugging Face conventions.
//!
//! - Architecture hyper-parameters come from the `{arch}.*` metadata keys.
//! - Tensor names map to Hugging Face names; shapes are `ne` reversed. A stack of
//!   experts (`blk.N.ffn_*_exps`, 3-D) becomes one tensor per expert, each a byte range
//!   of the stack (docs/MOE.md).
//! - Q/K projections of `llama` models are stored permuted by llama.cpp's converter;
//!   [`SourceModel::raw`] and [`SourceModel::f32`] return them in HF row order. Rows
//!   of a ggml tensor are independent byte runs (a row is a whole number of blocks),
//!   so quantized data is reordered without decoding it.
//! - All metadata is kept verbatim so a GGUF view can reproduce it.
//! - Value transforms that are not row orders stay as the file has them (Gemma's
//!   `1 + w` norms, GPT-2's transposed `Conv1D` matrices, whose shape here is the
//!   file's): the safetensors view undoes them when it serves (`layout`).

use std::collections::BTreeMap;
use std::path::Path;

use rayon::prelude::*;

use super::{ImportError, SourceModel};
use crate::gguf::quant;
use crate::gguf::{meta_get, GgmlType, GgufArray, GgufFile, GgufValue};
use crate::model::names;
use crate::model::{ArchConfig, ModelDesc, SourceType, TensorDesc};

pub struct GgufSource {
    desc: ModelDesc,
    file: GgufFile,
    /// Per desc tensor: how to read it from the file.
    plan: Vec<TensorPlan>,
}

struct TensorPlan {
    /// Index into `file.tensors`.
    gguf: usize,
    ty: GgmlType,
    /// Units that are permuted/independent: rows for ≥2-D tensors, elements for 1-D.
    units: u64,
    /// Bytes of one unit.
    unit_bytes: u64,
    /// Elements of one unit.
    unit_elems: u64,
    /// Heads of the rotary row permutation to undo, if any.
    permute: Option<u32>,
    /// Where this tensor's bytes lie in the file tensor's: all of them, or one
    /// expert's of a stack.
    bytes: std::ops::Range<usize>,
}

/// Read typed metadata with one-line errors naming the key.
struct Meta<'a> {
    meta: &'a [(String, GgufValue)],
}

impl Meta<'_> {
    fn get(&self, key: &str) -> Result<&GgufValue, String> {
        meta_get(self.meta, key).ok_or_else(|| format!("missing metadata key {key}"))
    }
    fn u32_opt(&self, key: &str) -> Result<Option<u32>, String> {
        match meta_get(self.meta, key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|x| u32::try_from(x).ok())
                .map(Some)
                .ok_or_else(|| {
                    format!("metadata key {key} = {v:?} is not a 32-bit unsigned integer")
                }),
        }
    }
    fn u32(&self, key: &str) -> Result<u32, String> {
        self.get(key)?;
        Ok(self.u32_opt(key)?.expect("present"))
    }
    fn f32_opt(&self, key: &str) -> Result<Option<f32>, String> {
        match meta_get(self.meta, key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(|x| Some(x as f32))
                .ok_or_else(|| format!("metadata key {key} = {v:?} is not a number")),
        }
    }
    fn str(&self, key: &str) -> Result<&str, String> {
        let v = self.get(key)?;
        v.as_str()
            .ok_or_else(|| format!("metadata key {key} = {v:?} is not a string"))
    }
}

fn arch_config(file: &GgufFile) -> Result<ArchConfig, String> {
    let m = Meta { meta: &file.meta };
    let arch = m.str("general.architecture")?.to_string();
    let model_type = match arch.as_str() {
        // Mixtral is written as a llama with experts.
        "llama" if m.u32_opt("llama.expert_count")?.unwrap_or(0) > 0 => "mixtral",
        "llama" => "llama",
        "qwen2moe" => "qwen2_moe",
        "qwen3moe" => "qwen3_moe",
        "olmoe" => "olmoe",
        "qwen2" => "qwen2",
        "qwen3" => "qwen3",
        "phi3" => "phi3",
        "gemma2" => "gemma2",
        "gpt2" => "gpt2",
        "bert" => "bert",
        other => {
            return Err(format!(
                "unsupported architecture {other} (llama, qwen2, qwen3, qwen2moe, qwen3moe, olmoe, phi3, gemma2, gpt2 and bert import)"
            ))
        }
    };
    let k = |s: &str| format!("{arch}.{s}");
    let hidden_size = m.u32(&k("embedding_length"))?;
    let n_heads = m.u32(&k("attention.head_count"))?;
    let n_kv_heads = m.u32_opt(&k("attention.head_count_kv"))?.unwrap_or(n_heads);
    if n_heads == 0 || n_kv_heads == 0 {
        return Err(format!(
            "{arch} has {n_heads} attention heads and {n_kv_heads} kv heads"
        ));
    }
    let head_dim = match m.u32_opt(&k("attention.key_length"))? {
        Some(d) => d,
        None if hidden_size % n_heads == 0 => hidden_size / n_heads,
        None => {
            return Err(format!(
                "embedding_length {hidden_size} is not a multiple of head_count {n_heads}"
            ))
        }
    };
    let vocab_size = match m.u32_opt(&k("vocab_size"))? {
        Some(v) => v,
        None => match meta_get(&file.meta, "tokenizer.ggml.tokens") {
            Some(GgufValue::Array(GgufArray::String(t))) => u32::try_from(t.len())
                .map_err(|_| "tokenizer.ggml.tokens is too long".to_string())?,
            _ => {
                return Err(format!(
                    "missing metadata key {} (and no tokenizer.ggml.tokens)",
                    k("vocab_size")
                ))
            }
        },
    };
    Ok(ArchConfig {
        model_type: model_type.into(),
        n_layers: m.u32(&k("block_count"))?,
        hidden_size,
        intermediate_size: m.u32(&k("feed_forward_length"))?,
        n_heads,
        n_kv_heads,
        head_dim,
        vocab_size,
        context_length: m.u32(&k("context_length"))?,
        rope_theta: m.f32_opt(&k("rope.freq_base"))?.unwrap_or(10000.0),
        // GPT-2's and BERT's LayerNorm epsilon where the others have an RMS norm's.
        rms_norm_eps: match m.f32_opt(&k("attention.layer_norm_rms_epsilon"))? {
            Some(e) => e,
            None if arch == "gpt2" || arch == "bert" => m
                .f32_opt(&k("attention.layer_norm_epsilon"))?
                .ok_or_else(|| {
                    format!("missing metadata key {}", k("attention.layer_norm_epsilon"))
                })?,
            None => {
                return Err(format!(
                    "missing metadata key {}",
                    k("attention.layer_norm_rms_epsilon")
                ))
            }
        },
        tie_word_embeddings: !file.tensors.iter().any(|t| t.name == "output.weight"),
        bos_token_id: m.u32_opt("tokenizer.ggml.bos_token_id")?,
        eos_token_id: m.u32_opt("tokenizer.ggml.eos_token_id")?,
        pad_token_id: m.u32_opt("tokenizer.ggml.padding_token_id")?,
        gguf_arch: Some(arch),
    })
}

fn plan_tensors(
    file: &GgufFile,
    arch: &ArchConfig,
) -> Result<(Vec<TensorDesc>, Vec<TensorPlan>), String> {
    let mut descs = Vec::with_capacity(file.tensors.len());
    let mut plans = Vec::with_capacity(file.tensors.len());
    let gguf_arch = arch.gguf_arch.as_deref().unwrap_or_default();
    for (gi, t) in file.tensors.iter().enumerate() {
        if !quant::is_supported(t.ty) {
            return Err(format!(
                "tensor {}: ggml type {:?} is not supported",
                t.name, t.ty
            ));
        }
        if t.ne.len() == 3 && t.name.contains("_exps.") {
            let (descs_e, plans_e) = split_experts(gi, t, gguf_arch)?;
            descs.extend(descs_e);
            plans.extend(plans_e);
            continue;
        }
        let name = names::gguf_to_hf(gguf_arch, &t.name)
            .ok_or_else(|| format!("tensor {} has no Hugging Face name", t.name))?;
        let source = source_type(t.ty);
        let shape: Vec<u64> = t.ne.iter().rev().copied().collect();
        let (be, bb) = t.ty.block();
        let (units, unit_bytes, unit_elems) = if shape.len() <= 1 {
            // 1-D: elements are the units (only permutable for unblocked types).
            let n = shape.first().copied().unwrap_or(1);
            if be == 1 {
                (n, bb, 1)
            } else {
                (1, t.n_bytes, n)
            }
        } else {
            let rows = shape[0];
            let per_row = t.n_bytes.checked_div(rows).unwrap_or(0);
            (rows, per_row, t.ne[0..t.ne.len() - 1].iter().product())
        };
        let permute = names::rope_permute_heads(
            arch.gguf_arch.as_deref(),
            &name,
            arch.n_heads,
            arch.n_kv_heads,
        );
        if let Some(h) = permute {
            let ok = if shape.len() <= 1 { be == 1 } else { true };
            if !ok || units % h as u64 != 0 || (units / h as u64) % 2 != 0 {
                return Err(format!(
                    "tensor {}: {units} rows cannot be split into {h} rotary heads of even size",
                    t.name
                ));
            }
        }
        descs.push(TensorDesc {
            name,
            shape,
            source,
        });
        plans.push(TensorPlan {
            gguf: gi,
            ty: t.ty,
            units,
            unit_bytes,
            unit_elems,
            permute,
            bytes: 0..usize::try_from(t.n_bytes)
                .map_err(|_| format!("tensor {} is too large", t.name))?,
        });
    }
    Ok((descs, plans))
}

/// How the model describes a tensor stored as `ty`.
fn source_type(ty: GgmlType) -> SourceType {
    match ty {
        GgmlType::F32 => SourceType::F32,
        GgmlType::F16 => SourceType::F16,
        GgmlType::BF16 => SourceType::BF16,
        q => SourceType::Ggml(q),
    }
}

/// A stack of experts (`ne = [cols, rows, n_expert]`) as one 2-D tensor per expert,
/// under the Hugging Face names of the architecture, each its own rows' bytes.
fn split_experts(
    gi: usize,
    t: &crate::gguf::GgufTensorInfo,
    gguf_arch: &str,
) -> Result<(Vec<TensorDesc>, Vec<TensorPlan>), String> {
    let (cols, rows, n) = (t.ne[0], t.ne[1], t.ne[2]);
    let per_expert = t.n_bytes.checked_div(n).unwrap_or(0);
    let row_bytes = per_expert.checked_div(rows).unwrap_or(0);
    if n == 0 || per_expert * n != t.n_bytes || row_bytes * rows != per_expert {
        return Err(format!(
            "tensor {}: {} bytes are not {n} experts of {rows} rows",
            t.name, t.n_bytes
        ));
    }
    let source = source_type(t.ty);
    let mut descs = Vec::new();
    let mut plans = Vec::new();
    for e in 0..n {
        let name = names::gguf_expert_to_hf(gguf_arch, &t.name, e)
            .ok_or_else(|| format!("tensor {} has no Hugging Face name", t.name))?;
        let start = usize::try_from(e * per_expert)
            .map_err(|_| format!("tensor {} is too large", t.name))?;
        descs.push(TensorDesc {
            name,
            shape: vec![rows, cols],
            source,
        });
        plans.push(TensorPlan {
            gguf: gi,
            ty: t.ty,
            units: rows,
            unit_bytes: row_bytes,
            unit_elems: cols,
            permute: None,
            bytes: start..start + per_expert as usize,
        });
    }
    Ok((descs, plans))
}

impl GgufSource {
    pub fn open(path: &Path) -> Result<GgufSource, ImportError> {
        let file = GgufFile::open(path)?;
        let invalid = |reason| ImportError::Invalid {
            path: path.display().to_string(),
            reason,
        };
        let arch = arch_config(&file).map_err(invalid)?;
        let (tensors, plan) = plan_tensors(&file, &arch).map_err(invalid)?;
        let desc = ModelDesc {
            arch,
            tensors,
            hf_files: BTreeMap::new(),
            gguf_meta: file.meta.clone(),
        };
        Ok(GgufSource { desc, file, plan })
    }

    fn plan(&self, i: usize) -> Result<&TensorPlan, ImportError> {
        self.plan.get(i).ok_or_else(|| ImportError::Invalid {
            path: self.file.path.display().to_string(),
            reason: format!(
                "tensor index {i} out of range ({} tensors)",
                self.plan.len()
            ),
        })
    }

    /// Source unit (row) that HF unit `r` comes from.
    fn src_unit(p: &TensorPlan, r: u64) -> u64 {
        match p.permute {
            Some(h) => names::hf_row_to_gguf(r, p.units, h),
            None => r,
        }
    }
}

/// Rows per rayon task: enough work per task to amortize scheduling.
const MIN_ROWS_PER_TASK: usize = 16;

impl SourceModel for GgufSource {
    fn desc(&self) -> &ModelDesc {
        &self.desc
    }

    fn raw(&self, i: usize) -> Result<Vec<u8>, ImportError> {
        let p = self.plan(i)?;
        let data = &self.file.tensor_data(p.gguf)[p.bytes.clone()];
        // Empty tensors (a zero dimension) have nothing to reorder.
        let out = if p.permute.is_none() || data.is_empty() {
            data.to_vec()
        } else {
            let ub = p.unit_bytes as usize;
            let mut out = vec![0u8; data.len()];
            for (r, dst) in out.chunks_exact_mut(ub).enumerate() {
                let g = Self::src_unit(p, r as u64) as usize;
                dst.copy_from_slice(&data[g * ub..(g + 1) * ub]);
            }
            out
        };
        self.file.release_tensor_data(p.gguf);
        Ok(out)
    }

    fn f32(&self, i: usize) -> Result<Vec<f32>, ImportError> {
        let p = self.plan(i)?;
        let data = &self.file.tensor_data(p.gguf)[p.bytes.clone()];
        let n = p
            .units
            .checked_mul(p.unit_elems)
            .and_then(|n| usize::try_from(n).ok());
        let n = n.ok_or_else(|| ImportError::Invalid {
            path: self.file.path.display().to_string(),
            reason: format!("tensor {} is too large", self.desc.tensors[i].name),
        })?;
        let mut out = vec![0f32; n];
        if n == 0 {
            return Ok(out);
        }
        let (ub, ue) = (p.unit_bytes as usize, p.unit_elems as usize);
        out.par_chunks_mut(ue)
            .with_min_len(MIN_ROWS_PER_TASK)
            .enumerate()
            .try_for_each(|(r, row)| {
                let g = Self::src_unit(p, r as u64) as usize;
                quant::dequantize(p.ty, &data[g * ub..(g + 1) * ub], row)
            })
            .map_err(|e| ImportError::Invalid {
                path: self.file.path.display().to_string(),
                reason: format!("tensor {}: {e}", self.file.tensors[p.gguf].name),
            })?;
        self.file.release_tensor_data(p.gguf);
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::GgufHeader;

    fn llama_meta(arch: &str) -> Vec<(String, GgufValue)> {
        let k = |s: &str| format!("{arch}.{s}");
        vec![
            (
                "general.architecture".into(),
                GgufValue::String(arch.into()),
            ),
            (k("block_count"), GgufValue::U32(1)),
            (k("embedding_length"), GgufValue::U32(64)),
            (k("feed_forward_length"), GgufValue::U32(96)),
            (k("attention.head_count"), GgufValue::U32(4)),
            (k("attention.head_count_kv"), GgufValue::U32(2)),
            (k("context_length"), GgufValue::U32(128)),
            (k("attention.layer_norm_rms_epsilon"), GgufValue::F32(1e-5)),
            (
                "tokenizer.ggml.tokens".into(),
                GgufValue::Array(GgufArray::String(vec!["a".to_string(); 32].into())),
            ),
            ("tokenizer.ggml.eos_token_id".into(), GgufValue::U32(2)),
        ]
    }

    fn write(
        dir: &Path,
        meta: Vec<(String, GgufValue)>,
        tensors: Vec<(String, Vec<u64>, GgmlType)>,
        fill: impl Fn(usize, &mut [u8]),
    ) -> std::path::PathBuf {
        let h = GgufHeader::new(meta, tensors, 32);
        let mut b = h.to_bytes();
        let base = b.len();
        b.resize(base + h.data_size() as usize, 0);
        for (i, t) in h.tensors.iter().enumerate() {
            let s = base + t.offset as usize;
            fill(i, &mut b[s..s + t.n_bytes as usize]);
        }
        let p = dir.join("m.gguf");
        std::fs::write(&p, b).unwrap();
        p
    }

    /// A Qwen2-MoE stack of 3 experts (Q8_0, 8 rows of 32 each) becomes three tensors
    /// under their Hugging Face names, each its own rows' bytes; a Mixtral is a llama
    /// with `expert_count`; a qwen3moe is a Qwen3-MoE.
    #[test]
    fn expert_stacks_split_into_experts() {
        let dir = tempfile::tempdir().unwrap();
        let mut meta = llama_meta("qwen2moe");
        meta.push(("qwen2moe.expert_count".into(), GgufValue::U32(3)));
        let p = write(
            dir.path(),
            meta,
            vec![
                (
                    "blk.0.ffn_up_exps.weight".into(),
                    vec![32, 8, 3],
                    GgmlType::Q8_0,
                ),
                (
                    "blk.0.ffn_gate_inp.weight".into(),
                    vec![64, 3],
                    GgmlType::F32,
                ),
            ],
            |i, b| {
                if i == 0 {
                    // Each byte: its expert's number.
                    for (j, x) in b.iter_mut().enumerate() {
                        *x = (j / (8 * 34)) as u8;
                    }
                }
            },
        );
        let s = GgufSource::open(&p).unwrap();
        let d = s.desc();
        assert_eq!(d.arch.model_type, "qwen2_moe");
        let names: Vec<&str> = d.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "model.layers.0.mlp.experts.0.up_proj.weight",
                "model.layers.0.mlp.experts.1.up_proj.weight",
                "model.layers.0.mlp.experts.2.up_proj.weight",
                "model.layers.0.mlp.gate.weight",
            ]
        );
        for e in 0..3 {
            assert_eq!(d.tensors[e].shape, [8, 32]);
            assert_eq!(d.tensors[e].source, SourceType::Ggml(GgmlType::Q8_0));
            assert_eq!(s.raw(e).unwrap(), vec![e as u8; 8 * 34]);
        }
        let mut meta = llama_meta("llama");
        meta.push(("llama.expert_count".into(), GgufValue::U32(2)));
        let p = write(
            dir.path(),
            meta,
            vec![(
                "blk.0.ffn_down_exps.weight".into(),
                vec![32, 4, 2],
                GgmlType::F16,
            )],
            |_, _| {},
        );
        let s = GgufSource::open(&p).unwrap();
        assert_eq!(s.desc().arch.model_type, "mixtral");
        assert_eq!(
            s.desc().tensors[1].name,
            "model.layers.0.block_sparse_moe.experts.1.w2.weight"
        );
        // Qwen3-MoE: llama.cpp's qwen3moe, transformers' qwen3_moe.
        let mut meta = llama_meta("qwen3moe");
        meta.push(("qwen3moe.expert_count".into(), GgufValue::U32(2)));
        let p = write(
            dir.path(),
            meta,
            vec![(
                "blk.1.ffn_gate_exps.weight".into(),
                vec![32, 4, 2],
                GgmlType::F16,
            )],
            |_, _| {},
        );
        let s = GgufSource::open(&p).unwrap();
        assert_eq!(s.desc().arch.model_type, "qwen3_moe");
        assert_eq!(
            s.desc().tensors[1].name,
            "model.layers.1.mlp.experts.1.gate_proj.weight"
        );
    }

    #[test]
    fn small_llama() {
        let dir = tempfile::tempdir().unwrap();
        // attn_q: 64 rows of 32 f32 (4 heads of 16); row g holds the value g everywhere.
        let p = write(
            dir.path(),
            llama_meta("llama"),
            vec![
                ("blk.0.attn_q.weight".into(), vec![32, 64], GgmlType::F32),
                ("blk.0.attn_v.weight".into(), vec![32, 8], GgmlType::Q8_0),
                ("token_embd.weight".into(), vec![32, 32], GgmlType::F16),
                ("output_norm.weight".into(), vec![32], GgmlType::F32),
            ],
            |i, b| {
                if i == 0 {
                    for (j, c) in b.chunks_exact_mut(4).enumerate() {
                        c.copy_from_slice(&((j / 32) as f32).to_le_bytes());
                    }
                }
            },
        );
        let s = GgufSource::open(&p).unwrap();
        let d = s.desc();
        assert_eq!(d.arch.model_type, "llama");
        assert_eq!(
            (d.arch.n_heads, d.arch.n_kv_heads, d.arch.head_dim),
            (4, 2, 16)
        );
        assert_eq!(d.arch.vocab_size, 32);
        assert_eq!(d.arch.rope_theta, 10000.0);
        assert!(d.arch.tie_word_embeddings);
        assert_eq!(d.arch.eos_token_id, Some(2));
        assert_eq!(d.arch.bos_token_id, None);
        assert_eq!(d.tensors[0].name, "model.layers.0.self_attn.q_proj.weight");
        assert_eq!(d.tensors[0].shape, vec![64, 32]);
        assert_eq!(d.tensors[1].source, SourceType::Ggml(GgmlType::Q8_0));
        assert_eq!(d.tensors[3].shape, vec![32]);
        assert_eq!(d.gguf_meta.len(), 11);
        let q = s.f32(0).unwrap();
        let raw = s.raw(0).unwrap();
        for r in 0..64u64 {
            let g = names::hf_row_to_gguf(r, 64, 4) as f32;
            assert!(q[r as usize * 32..][..32].iter().all(|&v| v == g));
            let rv = f32::from_le_bytes(raw[r as usize * 128..][..4].try_into().unwrap());
            assert_eq!(rv, g);
        }
        assert_eq!(s.f32(1).unwrap().len(), 256);
        assert!(s.f32(9).is_err());
    }

    #[test]
    fn errors() {
        let dir = tempfile::tempdir().unwrap();
        let t = || vec![("output_norm.weight".to_string(), vec![32], GgmlType::F32)];
        let p = write(dir.path(), llama_meta("mamba"), t(), |_, _| {});
        let e = GgufSource::open(&p).err().unwrap().to_string();
        assert!(e.contains("unsupported architecture mamba (llama, "), "{e}");
        let mut m = llama_meta("llama");
        m.retain(|(k, _)| k != "llama.block_count");
        let p = write(dir.path(), m, t(), |_, _| {});
        let e = GgufSource::open(&p).err().unwrap().to_string();
        assert!(
            e.ends_with(": missing metadata key llama.block_count"),
            "{e}"
        );
        let p = write(
            dir.path(),
            llama_meta("qwen2"),
            vec![("rope_freqs.weight".into(), vec![8], GgmlType::F32)],
            |_, _| {},
        );
        let e = GgufSource::open(&p).err().unwrap().to_string();
        assert!(
            e.contains("rope_freqs.weight has no Hugging Face name"),
            "{e}"
        );
    }
}
