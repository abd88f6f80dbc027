//! Hugging Face directory importer: `config.json`, `model.safetensors` or shards listed
//! in `model.safetensors.index.json`, and the tokenizer files, kept verbatim.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

use super::{ImportError, SourceModel};
use crate::gguf::GgmlType;
use crate::model::{
    check_hf_file_name, ArchConfig, ModelDesc, SourceType, TensorDesc, MAX_HF_FILES,
};

/// Extensions of the side files kept verbatim: configs, tokenizers (JSON, SentencePiece
/// `.model`, tiktoken, vocabularies), chat templates, custom code and the model card.
/// Weights (`.safetensors`, `.bin`, `.gguf` ...) are not among them.
const KEPT_EXTENSIONS: &[&str] = &["json", "txt", "model", "jinja", "tiktoken", "py", "md"];

/// Side files that describe the source's own weight files, which the mount does not
/// serve (it makes its own `model.safetensors`, and an index for its shards).
const NOT_KEPT: &[&str] = &[
    "model.safetensors.index.json",
    "pytorch_model.bin.index.json",
    "tf_model.h5.index.json",
    "flax_model.msgpack.index.json",
];

/// The side files of `dir` to keep: regular files directly in it with a kept
/// extension, and those of the subdirectories sentence-transformers' `modules.json`
/// names (`1_Pooling/config.json` ...: without them `SentenceTransformer` cannot load
/// the directory), at most [`MAX_HF_FILES`] in all, sorted by name.
pub(crate) fn side_files(dir: &Path) -> Result<Vec<(String, PathBuf)>, ImportError> {
    let mut out = kept_files(dir, "")?;
    if let Some((_, p)) = out.iter().find(|(n, _)| n == "modules.json") {
        for sub in module_dirs(&read_small(p)?) {
            let d = dir.join(&sub);
            if std::fs::metadata(&d).is_ok_and(|m| m.is_dir()) {
                out.extend(kept_files(&d, &format!("{sub}/"))?);
            }
        }
    }
    out.sort();
    if out.len() > MAX_HF_FILES {
        return Err(invalid(
            dir,
            format!(
                "{} side files (configs, tokenizers ...) is more than the {MAX_HF_FILES} a model may keep",
                out.len()
            ),
        ));
    }
    Ok(out)
}

/// The module directories a sentence-transformers `modules.json` names (`"path"` of
/// each module, one plain path component; the model itself is `""`).
pub(crate) fn module_dirs(modules: &[u8]) -> Vec<String> {
    let Ok(Value::Array(mods)) = serde_json::from_slice::<Value>(modules) else {
        return Vec::new();
    };
    mods.iter()
        .filter_map(|m| m.get("path")?.as_str())
        .filter(|p| check_hf_file_name(p).is_ok() && !p.contains('/'))
        .map(str::to_string)
        .collect()
}

/// Regular files directly in `dir` with a kept extension, named `prefix` + file name.
fn kept_files(dir: &Path, prefix: &str) -> Result<Vec<(String, PathBuf)>, ImportError> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(|e| io(dir, e))? {
        let entry = entry.map_err(|e| io(dir, e))?;
        let Some(name) = entry.file_name().to_str().map(str::to_string) else {
            continue;
        };
        let full = format!("{prefix}{name}");
        let kept = is_side_file(&name, &full);
        // `metadata` follows a symbolic link (Hugging Face caches are made of them).
        if kept && std::fs::metadata(entry.path()).is_ok_and(|m| m.is_file()) {
            out.push((full, entry.path()));
        }
        if out.len() > MAX_HF_FILES {
            break;
        }
    }
    Ok(out)
}

/// Whether file `name`, kept as `full` (`prefix` + name), is a side file to keep.
pub(crate) fn is_side_file(name: &str, full: &str) -> bool {
    let ext = name.rsplit_once('.').map(|(_, e)| e.to_ascii_lowercase());
    ext.is_some_and(|e| KEPT_EXTENSIONS.contains(&e.as_str()))
        && !NOT_KEPT.contains(&name)
        && !name.starts_with('.')
        && check_hf_file_name(full).is_ok()
}

/// Side files larger than this are refused: they are tokenizers and configs, not weights.
const MAX_SIDE_FILE: u64 = 64 << 20;

pub struct HfSource {
    desc: ModelDesc,
    shards: Vec<Mmap>,
    /// Per tensor: (shard index, byte range within the shard's data).
    locations: Vec<(usize, std::ops::Range<usize>)>,
}

fn invalid(path: &Path, reason: impl Into<String>) -> ImportError {
    ImportError::Invalid {
        path: path.display().to_string(),
        reason: reason.into(),
    }
}

fn io(path: &Path, source: std::io::Error) -> ImportError {
    ImportError::Io {
        path: path.display().to_string(),
        source,
    }
}

fn read_small(path: &Path) -> Result<Vec<u8>, ImportError> {
    let len = std::fs::metadata(path).map_err(|e| io(path, e))?.len();
    if len > MAX_SIDE_FILE {
        return Err(invalid(
            path,
            format!("{len} bytes is too large for a metadata file"),
        ));
    }
    std::fs::read(path).map_err(|e| io(path, e))
}

impl HfSource {
    pub fn open(dir: &Path) -> Result<HfSource, ImportError> {
        let cfg_path = dir.join("config.json");
        if !cfg_path.exists() {
            return Err(invalid(
                dir,
                "not a Hugging Face model directory: config.json is missing",
            ));
        }
        let mut hf_files = BTreeMap::new();
        for (name, p) in side_files(dir)? {
            hf_files.insert(name, read_small(&p)?);
        }
        let config: Value = serde_json::from_slice(&hf_files["config.json"])
            .map_err(|e| invalid(&cfg_path, format!("not valid JSON: {e}")))?;

        let shard_paths = shard_paths(dir)?;
        let mut shards = Vec::new();
        let mut tensors = Vec::new();
        let mut locations = Vec::new();
        for (si, p) in shard_paths.iter().enumerate() {
            let f = File::open(p).map_err(|e| io(p, e))?;
            // SAFETY: the source file is only read; a concurrent writer could change the
            // bytes under us, which yields wrong values but not memory unsafety in the
            // bounds-checked code below.
            let map = unsafe { Mmap::map(&f) }.map_err(|e| io(p, e))?;
            let (header_len, _) = SafeTensors::read_metadata(&map)
                .map_err(|e| invalid(p, format!("not a valid safetensors file: {e}")))?;
            let st = SafeTensors::deserialize(&map)
                .map_err(|e| invalid(p, format!("not a valid safetensors file: {e}")))?;
            let data_start = 8 + header_len;
            let mut names: Vec<(String, safetensors::tensor::TensorView)> = st.tensors();
            names.sort_by(|a, b| a.0.cmp(&b.0));
            for (name, view) in names {
                let source = source_type(view.dtype()).ok_or_else(|| {
                    invalid(
                        p,
                        format!(
                            "tensor {name}: unsupported dtype {:?} (whole-byte types are)",
                            view.dtype()
                        ),
                    )
                })?;
                let bytes = view.data();
                let start = bytes.as_ptr() as usize - map.as_ptr() as usize;
                debug_assert!(start >= data_start);
                tensors.push(TensorDesc {
                    name,
                    shape: view.shape().iter().map(|&d| d as u64).collect(),
                    source,
                });
                locations.push((si, start..start + bytes.len()));
            }
            shards.push(map);
        }
        // Canonical order: by layer, then name, so archives group a layer's tensors.
        let mut order: Vec<usize> = (0..tensors.len()).collect();
        order.sort_by_key(|&i| sort_key(&tensors[i].name));
        let tensors: Vec<TensorDesc> = order.iter().map(|&i| tensors[i].clone()).collect();
        let locations = order.iter().map(|&i| locations[i].clone()).collect();
        if let Some(dup) = tensors.windows(2).find(|w| w[0].name == w[1].name) {
            return Err(invalid(
                dir,
                format!("tensor {} appears in two shards", dup[0].name),
            ));
        }
        let arch = arch_from_config(&cfg_path, &config, &tensors)?;
        Ok(HfSource {
            desc: ModelDesc {
                arch,
                tensors,
                hf_files,
                gguf_meta: Vec::new(),
            },
            shards,
            locations,
        })
    }
}

/// The model's type for a safetensors dtype; None for one the archive cannot hold
/// (sub-byte MX types).
pub(crate) fn source_type(d: Dtype) -> Option<SourceType> {
    Some(match d {
        Dtype::F32 => SourceType::F32,
        Dtype::F16 => SourceType::F16,
        Dtype::BF16 => SourceType::BF16,
        other => SourceType::Plain(crate::model::PlainType::of_safetensors(other)?),
    })
}

/// (non-layer first, layer number, name): embeddings, then layers in order, then the
/// rest. Names of other architectures (`encoder.layer.10...`, `h.3...`) sort
/// naturally: numbers by value, so layer 10 follows layer 9.
pub(crate) fn sort_key(name: &str) -> (u8, u32, Vec<NamePart>) {
    match crate::model::names::layer_of(name) {
        Some(l) => (1, l, natural(name)),
        None if name.contains("embed") => (0, 0, natural(name)),
        None => (2, 0, natural(name)),
    }
}

/// A run of a name: text, or a number compared by value (then by its digits, so
/// `01` and `1` stay distinct).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum NamePart {
    Text(String),
    Num(u128, String),
}

fn natural(name: &str) -> Vec<NamePart> {
    let mut parts = Vec::new();
    let mut rest = name;
    while let Some(c) = rest.chars().next() {
        let digit = c.is_ascii_digit();
        let end = rest
            .find(|ch: char| ch.is_ascii_digit() != digit)
            .unwrap_or(rest.len());
        let (run, tail) = rest.split_at(end);
        parts.push(match run.parse::<u128>() {
            Ok(n) if digit => NamePart::Num(n, run.to_string()),
            _ => NamePart::Text(run.to_string()),
        });
        rest = tail;
    }
    parts
}

fn shard_paths(dir: &Path) -> Result<Vec<PathBuf>, ImportError> {
    let index = dir.join("model.safetensors.index.json");
    if index.is_file() {
        let v: Value = serde_json::from_slice(&read_small(&index)?)
            .map_err(|e| invalid(&index, format!("not valid JSON: {e}")))?;
        let map = v
            .get("weight_map")
            .and_then(Value::as_object)
            .ok_or_else(|| invalid(&index, "no weight_map object"))?;
        let mut files: Vec<String> = Vec::new();
        for (tensor, file) in map {
            let file = file.as_str().ok_or_else(|| {
                invalid(
                    &index,
                    format!("weight_map entry {tensor} is not a file name"),
                )
            })?;
            if file.contains('/') || file.contains("..") {
                return Err(invalid(
                    &index,
                    format!("weight_map entry {tensor} points outside the directory: {file}"),
                ));
            }
            if !files.iter().any(|f| f == file) {
                files.push(file.to_string());
            }
        }
        files.sort();
        let paths: Vec<PathBuf> = files.iter().map(|f| dir.join(f)).collect();
        if let Some(missing) = paths.iter().find(|p| !p.is_file()) {
            return Err(invalid(
                &index,
                format!("shard {} is missing", missing.display()),
            ));
        }
        return Ok(paths);
    }
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    Err(invalid(
        dir,
        "no model.safetensors or model.safetensors.index.json",
    ))
}

/// `model_type` of a config and the GGUF architecture llama.cpp knows it as, if this
/// build can serve a GGUF view of it.
fn model_type_of(path: &Path, c: &Value) -> Result<(String, Option<String>), ImportError> {
    let model_type = c
        .get("model_type")
        .and_then(Value::as_str)
        .ok_or_else(|| invalid(path, "missing model_type"))?
        .to_string();
    let gguf_arch = crate::model::names::gguf_arch_of(&model_type).map(str::to_string);
    Ok((model_type, gguf_arch))
}

/// The architecture of a Hugging Face config. A model with a GGUF mapping must give
/// the hyper-parameters its GGUF metadata needs; for any other model they are read
/// where the config has them under the usual names and 0 otherwise (only the GGUF
/// view uses them).
pub(crate) fn arch_from_config(
    path: &Path,
    c: &Value,
    tensors: &[TensorDesc],
) -> Result<ArchConfig, ImportError> {
    let (model_type, gguf_arch) = model_type_of(path, c)?;
    let required = gguf_arch.is_some();
    let model_type_is_gpt2 = model_type == "gpt2";
    // GPT-2's config names the same hyper-parameters its own way (`n_embd` ...);
    // transformers maps them (GPT2Config.attribute_map), so do we.
    fn alias(key: &str) -> &str {
        match key {
            "hidden_size" => "n_embd",
            "num_attention_heads" => "n_head",
            "num_hidden_layers" => "n_layer",
            "intermediate_size" => "n_inner",
            "max_position_embeddings" => "n_positions",
            _ => key,
        }
    }
    let opt_u = |key: &str| {
        c.get(key)
            .or_else(|| c.get(alias(key)))
            .and_then(Value::as_u64)
            .and_then(|v| u32::try_from(v).ok())
    };
    let u = |key: &str| -> Result<u32, ImportError> {
        match opt_u(key) {
            Some(v) => Ok(v),
            None if !required => Ok(0),
            None => Err(invalid(path, format!("missing or invalid {key}"))),
        }
    };
    let f = |key: &str, default: f64| c.get(key).and_then(Value::as_f64).unwrap_or(default) as f32;
    let hidden_size = u("hidden_size")?;
    let n_heads = u("num_attention_heads")?;
    if required && (n_heads == 0 || hidden_size % n_heads != 0 && opt_u("head_dim").is_none()) {
        return Err(invalid(
            path,
            format!("hidden_size {hidden_size} is not a multiple of num_attention_heads {n_heads}"),
        ));
    }
    let has_lm_head = tensors.iter().any(|t| t.name == "lm_head.weight");
    // GPT-2's MLP is 4 × hidden wide unless `n_inner` says otherwise (null by default).
    let intermediate_size = match opt_u("intermediate_size") {
        None if model_type_is_gpt2 => hidden_size.saturating_mul(4),
        _ => u("intermediate_size")?,
    };
    Ok(ArchConfig {
        model_type,
        gguf_arch,
        n_layers: u("num_hidden_layers")?,
        hidden_size,
        intermediate_size,
        n_heads,
        n_kv_heads: opt_u("num_key_value_heads").unwrap_or(n_heads),
        head_dim: opt_u("head_dim").unwrap_or(hidden_size.checked_div(n_heads).unwrap_or(0)),
        vocab_size: u("vocab_size")?,
        context_length: opt_u("max_position_embeddings").unwrap_or(2048),
        // transformers 5 writes it only inside `rope_parameters`.
        rope_theta: c
            .get("rope_theta")
            .or_else(|| c.get("rope_parameters")?.get("rope_theta"))
            .and_then(Value::as_f64)
            .unwrap_or(10000.0) as f32,
        rms_norm_eps: f("rms_norm_eps", 1e-6),
        tie_word_embeddings: !has_lm_head,
        bos_token_id: opt_u("bos_token_id"),
        eos_token_id: opt_u("eos_token_id"),
        pad_token_id: opt_u("pad_token_id"),
    })
}

impl SourceModel for HfSource {
    fn desc(&self) -> &ModelDesc {
        &self.desc
    }
    fn raw(&self, i: usize) -> Result<Vec<u8>, ImportError> {
        let (s, r) = &self.locations[i];
        let out = self.shards[*s][r.clone()].to_vec();
        crate::mem::release_pages(&self.shards[*s], r.clone());
        Ok(out)
    }
    fn f32(&self, i: usize) -> Result<Vec<f32>, ImportError> {
        let (s, r) = &self.locations[i];
        let bytes = &self.shards[*s][r.clone()];
        let t = &self.desc.tensors[i];
        let mut out = vec![0f32; t.numel() as usize];
        let ty = match t.source {
            SourceType::F32 => GgmlType::F32,
            SourceType::F16 => GgmlType::F16,
            SourceType::BF16 => GgmlType::BF16,
            SourceType::Ggml(ty) => ty,
            SourceType::Plain(p) => {
                p.to_f32(bytes, &mut out);
                crate::mem::release_pages(&self.shards[*s], r.clone());
                return Ok(out);
            }
        };
        crate::gguf::quant::dequantize(ty, bytes, &mut out).map_err(|e| ImportError::Invalid {
            path: format!("tensor {}", t.name),
            reason: e.to_string(),
        })?;
        crate::mem::release_pages(&self.shards[*s], r.clone());
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_theta_is_read_at_the_top_or_in_rope_parameters() {
        let base = serde_json::json!({
            "model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
            "num_hidden_layers": 1, "intermediate_size": 128, "vocab_size": 10,
        });
        let theta = |extra: Value| {
            let mut c = base.clone();
            c.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            arch_from_config(Path::new("config.json"), &c, &[])
                .unwrap()
                .rope_theta
        };
        assert_eq!(theta(serde_json::json!({})), 10000.0);
        assert_eq!(theta(serde_json::json!({"rope_theta": 500000.0})), 500000.0);
        let nested = serde_json::json!({"rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}});
        assert_eq!(theta(nested), 100000.0);
    }
}

#[cfg(test)]
mod side_file_tests {
    use super::*;

    #[test]
    fn names_sort_layers_by_number() {
        let mut names = vec![
            "encoder.layer.10.output.dense.weight",
            "encoder.layer.2.output.dense.weight",
            "embeddings.word_embeddings.weight",
            "pooler.dense.weight",
            "encoder.layer.1.attention.self.query.weight",
        ];
        names.sort_by_key(|n| sort_key(n));
        assert_eq!(
            names,
            [
                "embeddings.word_embeddings.weight",
                "encoder.layer.1.attention.self.query.weight",
                "encoder.layer.2.output.dense.weight",
                "encoder.layer.10.output.dense.weight",
                "pooler.dense.weight",
            ]
        );
    }

    #[test]
    fn side_files_are_small_text_files_not_weights() {
        let d = tempfile::tempdir().unwrap();
        for f in [
            "config.json",
            "tokenizer.model",
            "vocab.txt",
            "chat_template.jinja",
            "README.md",
            "modeling_custom.py",
            "model.safetensors",
            "model.safetensors.index.json",
            "pytorch_model.bin",
            ".gitattributes",
            "weights.gguf",
        ] {
            std::fs::write(d.path().join(f), b"x").unwrap();
        }
        std::fs::create_dir(d.path().join("1_Pooling.json")).unwrap();
        let names: Vec<String> = side_files(d.path())
            .unwrap()
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        assert_eq!(
            names,
            [
                "README.md",
                "chat_template.jinja",
                "config.json",
                "modeling_custom.py",
                "tokenizer.model",
                "vocab.txt",
            ]
        );
        // The module directories sentence-transformers' modules.json names, not others.
        let mods = r#"[{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                       {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                       {"idx": 2, "name": "2", "path": "../up", "type": "x"}]"#;
        std::fs::write(d.path().join("modules.json"), mods).unwrap();
        for sub in ["1_Pooling", "onnx", "up"] {
            std::fs::create_dir_all(d.path().join(sub)).unwrap();
            std::fs::write(d.path().join(sub).join("config.json"), b"{}").unwrap();
            std::fs::write(d.path().join(sub).join("model.onnx"), b"x").unwrap();
        }
        let names: Vec<String> = side_files(d.path())
            .unwrap()
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        assert!(
            names.contains(&"1_Pooling/config.json".to_string()),
            "{names:?}"
        );
        assert!(names.contains(&"modules.json".to_string()));
        assert!(
            !names
                .iter()
                .any(|n| n.contains("onnx") || n.contains("up/")),
            "{names:?}"
        );
    }
}
