//! Prints the ggml type `llama-quantize GGUF out.gguf PRESET` would give each tensor of a
//! GGUF file, from cawsfs's port of its rules (`cawsfs::layout::preset_types`), so
//! tests/clients/test_presets.py can compare the two. A stand-in until the mount serves
//! preset views itself.
//!
//! `cargo run --release --example preset_types -- PRESET FILE.gguf` prints one line per
//! tensor in file order: `name type`, plus the type it wanted when that did not fit its
//! row length (`blk.0.attn_q.weight Q5_0 Q4_K`).

use std::path::Path;
use std::process::ExitCode;

use cawsfs::gguf::{meta_get, GgufFile};
use cawsfs::layout::{preset_types, Preset, PresetModel, PresetTensor};

fn run(preset: &str, path: &str) -> Result<String, String> {
    let preset = Preset::parse(preset).ok_or_else(|| format!("unknown preset {preset}"))?;
    let f = GgufFile::open(Path::new(path)).map_err(|e| format!("{path}: {e}"))?;
    let arch = meta_get(&f.meta, "general.architecture")
        .and_then(|v| v.as_str())
        .ok_or("no general.architecture")?;
    let num = |key: &str| {
        meta_get(&f.meta, &format!("{arch}.{key}"))
            .and_then(|v| v.as_u64())
            .map(|v| v as u32)
    };
    let n_head = num("attention.head_count").unwrap_or(0);
    let model = PresetModel {
        arch,
        n_layers: num("block_count").ok_or("no block_count")?,
        n_head,
        // llama.cpp's default when the key is absent: as many KV heads as heads.
        n_head_kv: num("attention.head_count_kv").unwrap_or(n_head),
        n_expert: num("expert_count").unwrap_or(0),
    };
    let tensors: Vec<PresetTensor<'_>> = f
        .tensors
        .iter()
        .map(|t| PresetTensor {
            name: &t.name,
            ne: &t.ne,
        })
        .collect();
    let types = preset_types(preset, &model, &tensors).map_err(|e| e.to_string())?;
    let mut out = String::new();
    for (t, (ty, wanted)) in tensors.iter().zip(types) {
        out.push_str(&format!("{} {ty:?}", t.name));
        if let Some(w) = wanted {
            out.push_str(&format!(" {w:?}"));
        }
        out.push('\n');
    }
    Ok(out)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [preset, path] = args.as_slice() else {
        eprintln!("usage: preset_types PRESET FILE.gguf");
        return ExitCode::from(2);
    };
    match run(preset, path) {
        Ok(s) => {
            print!("{s}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("preset_types: {e}");
            ExitCode::FAILURE
        }
    }
}
