//! Directories without `cawsfs.json` (written by Squish or by hand): each manifest entry
//! is matched to its tensor files, whose kind is chosen in seed 002's priority (int4,
//! int8, passthrough), and the model description comes from `config.json` and the
//! tokenizer files (docs/NPYDIR.md §1, §2, §5).

use std::collections::{BTreeMap, HashSet};

use serde_json::Value;

use super::files::{read_shape_file, Opener};
use super::geometry::{check_quant, Geo, Geometry};
use super::npy::Dtype;
use super::{read_small, Entry, Opened, MANIFEST, TENSOR_DIR};
use crate::archive::container::invalid;
use crate::archive::dir::ArchiveDir;
use crate::archive::ArchiveError;
use crate::import::hf::{is_side_file, module_dirs};
use crate::model::MAX_HF_FILES;
use crate::model::{ModelDesc, SourceType, TensorDesc};

/// The suffixes of the files one tensor may have (NPYDIR.md §2).
const SUFFIXES: &[&str] = &["__q4", "__s4", "__q", "__s", "__pt", "__shape"];

pub(super) fn open_foreign(
    op: &Opener,
    manifest: &[(String, String)],
    files: &HashSet<String>,
) -> Result<Opened, ArchiveError> {
    let dir = op.dir;
    let mpath = dir.join(MANIFEST);
    let cfg = dir.join("config.json");
    if !op.src.is_file("config.json") {
        return Err(invalid(
            dir,
            "config.json is missing: an npy-dir needs the model's config.json and tokenizer files beside manifest.json",
        ));
    }
    let mut hf_files = BTreeMap::new();
    let mut parts = vec![(MANIFEST.to_string(), op.src.len(MANIFEST))];
    for name in side_files(op.src)? {
        if name == MANIFEST {
            continue;
        }
        let b = read_small(op.src, &name)?;
        parts.push((name.clone(), b.len() as u64));
        hf_files.insert(name, b);
    }
    let config: Value = serde_json::from_slice(&hf_files["config.json"])
        .map_err(|e| invalid(&cfg, format!("not valid JSON: {e}")))?;
    let mut named = Vec::new();
    let mut seen = HashSet::new();
    for (a, b) in manifest {
        let (name, key) = match (has_any(files, a), has_any(files, b)) {
            (false, true) => (a, b),
            (true, false) => (b, a),
            (false, false) => {
                return Err(invalid(
                    &mpath,
                    format!("entry {a:?}: no files tensors/{b}__*.npy[.zst] (nor tensors/{a}__*)"),
                ))
            }
            (true, true) => {
                return Err(invalid(
                    &mpath,
                    format!("entry {a:?}: both sides name tensor files"),
                ))
            }
        };
        if !seen.insert(name.clone()) {
            return Err(invalid(&mpath, format!("tensor {name} is listed twice")));
        }
        named.push((name, key));
    }
    let mut items = op.each(&named, |op, (name, key)| {
        open_foreign_tensor(op, name, key, files)
    })?;
    items.sort_by_key(|(t, _)| crate::import::hf::sort_key(&t.name));
    let (tensors, entries): (Vec<TensorDesc>, Vec<Entry>) = items.into_iter().unzip();
    let arch = crate::import::hf::arch_from_config(&cfg, &config, &tensors)
        .map_err(|e| invalid(&cfg, e.to_string()))?;
    Ok(Opened {
        model: ModelDesc {
            arch,
            tensors,
            hf_files,
            gguf_meta: Vec::new(),
        },
        entries,
        routing: Vec::new(),
        extra: serde_json::json!({
            "checksums": false,
            "note": "no cawsfs.json: Squish files carry no checksums; structural checks only",
        }),
        checksummed: false,
        parts,
    })
}

fn open_foreign_tensor(
    op: &Opener,
    name: &str,
    key: &str,
    files: &HashSet<String>,
) -> Result<(TensorDesc, Entry), ArchiveError> {
    let dir = op.dir;
    let get = |s: &str| pick(files, key, s);
    let shape_file = get("__shape");
    let shape_of = |op: &Opener| -> Result<(Vec<u64>, u64), ArchiveError> {
        let f = shape_file.as_ref().ok_or_else(|| {
            invalid(
                &dir.join(TENSOR_DIR),
                format!("tensor {name}: {key}__shape.npy is missing"),
            )
        })?;
        let (s, len, _) = read_shape_file(op, f)?;
        Ok((s, len))
    };
    // Priority of seed 002 §15.5: int4, then int8, then passthrough.
    let quant = match (get("__q4"), get("__s4"), get("__q"), get("__s")) {
        (Some(q), Some(s), _, _) => Some((q, s, true)),
        (_, _, Some(q), Some(s)) => Some((q, s, false)),
        _ => None,
    };
    let (shape, geo, files, stored, source) = if let Some((qn, sn, int4)) = quant {
        let (shape, slen) = shape_of(op)?;
        let q = op.open(&qn, &[if int4 { Dtype::U8 } else { Dtype::I8 }], None)?;
        let s = op.open(&sn, &[Dtype::F32], None)?;
        let geo = check_quant(dir, shape.iter().product(), &q, &s, int4)?;
        let stored = slen + q.file_len + s.file_len;
        (shape, geo, vec![q, s], stored, SourceType::F16)
    } else if let Some(ptn) = get("__pt") {
        let pt = op
            .open(&ptn, &Dtype::PASSTHROUGH, None)
            .map_err(|e| match e {
                // Name the tensor too: the file's name is its key, not its name.
                ArchiveError::Invalid { path, reason } => ArchiveError::Invalid {
                    path,
                    reason: format!("tensor {name}: {reason}"),
                },
                e => e,
            })?;
        let (shape, slen) = if shape_file.is_some() {
            shape_of(op)?
        } else {
            (pt.header.shape.clone(), 0)
        };
        if pt.header.numel() != shape.iter().product::<u64>() {
            return Err(invalid(
                &dir.join(&pt.rel),
                format!(
                    "holds {} elements, the shape file says {shape:?}",
                    pt.header.numel()
                ),
            ));
        }
        let source = pt.header.dtype.source();
        let stored = slen + pt.file_len;
        let geo = Geo::Pt {
            format: Some(source),
        };
        (shape, geo, vec![pt], stored, source)
    } else {
        return Err(invalid(
            &dir.join(TENSOR_DIR),
            format!("tensor {name}: none of {key}__q4+__s4, __q+__s or __pt is present"),
        ));
    };
    let t = TensorDesc {
        name: name.to_string(),
        shape,
        source,
    };
    let geom = Geometry {
        rows: t.rows(),
        cols: t.cols(),
        rows_per_block: crate::archive::container::rows_per_block(&t),
        geo,
    };
    Ok((
        t,
        Entry {
            geom,
            files,
            stored_bytes: stored,
            shape_part: shape_file.map(|f| {
                let rel = format!("{TENSOR_DIR}/{f}");
                (rel.clone(), op.src.len(&rel))
            }),
        },
    ))
}

/// The model's side files (configs, tokenizer, sentence-transformers modules) as Hugging
/// Face directories keep them (`import::hf`'s rules), sorted, by their names here.
fn side_files(src: &ArchiveDir) -> Result<Vec<String>, ArchiveError> {
    let kept = |sub: &str| -> Result<Vec<String>, ArchiveError> {
        let lead = if sub.is_empty() {
            String::new()
        } else {
            format!("{sub}/")
        };
        Ok(src
            .names(sub)?
            .into_iter()
            .map(|n| (format!("{lead}{n}"), n))
            .filter(|(full, n)| is_side_file(n, full) && src.is_file(full))
            .map(|(full, _)| full)
            .collect())
    };
    let mut out = kept("")?;
    if out.iter().any(|n| n == "modules.json") {
        for sub in module_dirs(&read_small(src, "modules.json")?) {
            if src.is_dir(&sub) {
                out.extend(kept(&sub)?);
            }
        }
    }
    out.sort();
    if out.len() > MAX_HF_FILES {
        return Err(invalid(
            src.path(),
            format!(
                "{} side files (configs, tokenizers ...) is more than the {MAX_HF_FILES} a model may keep",
                out.len()
            ),
        ));
    }
    Ok(out)
}

/// The name in `tensors/` of `{key}{suffix}`: `.npy` if present, else `.npy.zst`.
fn pick(files: &HashSet<String>, key: &str, suffix: &str) -> Option<String> {
    let plain = format!("{key}{suffix}.npy");
    if files.contains(&plain) {
        return Some(plain);
    }
    let z = format!("{plain}.zst");
    files.contains(&z).then_some(z)
}

fn has_any(files: &HashSet<String>, key: &str) -> bool {
    SUFFIXES.iter().any(|s| pick(files, key, s).is_some())
}
