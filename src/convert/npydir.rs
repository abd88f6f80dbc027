//! `cawsfs convert --to npy-dir`: quantize a source model into a Squish npy-dir
//! (docs/NPYDIR.md §6) with a `cawsfs.json` holding the model description and an
//! XXH3-64 per row block of every data file.
//!
//! Tensors are quantized in parallel (rayon) in windows; each writes its own files, and
//! everything shared (manifest, cawsfs.json) is assembled in model order, so the bytes do
//! not depend on the thread count.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use half::slice::HalfFloatSliceExt;

use serde_json::{json, Value};
use xxhash_rust::xxh3::xxh3_64;

use crate::archive::npydir::npy::{self, Dtype};
use crate::archive::npydir::{hex, safe_key, seal_sidecar, SideFile, SideTensor, Sidecar};
use crate::archive::npydir::{MANIFEST, ROUTING_FILE, SIDECAR, TENSOR_DIR};
use crate::archive::ArchiveError;
use crate::codec::intq as quant;
use crate::codec::le;
use crate::convert::{ConvertError, ConvertReport, Patterns, TensorReport};
use crate::import::SourceModel;
use crate::model::{SourceType, TensorDesc};

/// zstd level of `--zstd` (seed 002 §15.2 uses 3).
const ZSTD_LEVEL: i32 = 3;

#[derive(Clone, Debug)]
pub struct NpyOptions {
    /// 8 (int8 per row) or 4 (int4 per group).
    pub bits: u8,
    /// Columns per int4 scale.
    pub group: usize,
    /// Write data files as framed `.npy.zst`.
    pub zstd: bool,
    /// Tensors matching one of these glob patterns ([`Patterns`]) are stored as f16
    /// passthrough.
    pub passthrough: Vec<String>,
    /// Tensors quantized at once; bounds peak memory.
    pub window: usize,
}

impl Default for NpyOptions {
    fn default() -> Self {
        NpyOptions {
            bits: 8,
            group: 64,
            zstd: false,
            passthrough: crate::convert::ConvertOptions::default().passthrough,
            window: 8,
        }
    }
}

fn io(path: &Path, source: std::io::Error) -> ConvertError {
    ConvertError::File(ArchiveError::Io {
        path: path.display().to_string(),
        source,
    })
}

/// One data file of a tensor, ready to write.
struct Component {
    role: &'static str,
    suffix: &'static str,
    dtype: Dtype,
    shape: Vec<u64>,
    data: Vec<u8>,
    /// Bytes per row of `data` (rows are the tensor's rows).
    row_bytes: usize,
}

struct Written {
    side: SideTensor,
    report: TensorReport,
    quantized: bool,
}

/// Write `tensors/{file}` for `c`; returns its cawsfs.json entry.
fn write_component(
    tdir: &Path,
    key: &str,
    c: &Component,
    rpb: usize,
    zstd: bool,
) -> Result<(SideFile, u64), ConvertError> {
    let header = npy::write_header(c.dtype, &c.shape);
    let block_bytes = (rpb * c.row_bytes).max(1);
    let blocks: Vec<&[u8]> = if c.data.is_empty() {
        vec![]
    } else {
        c.data.chunks(block_bytes).collect()
    };
    let sums = blocks.iter().map(|b| hex(xxh3_64(b))).collect();
    let name = format!("{key}{}.npy{}", c.suffix, if zstd { ".zst" } else { "" });
    let path = tdir.join(&name);
    let mut out = Vec::with_capacity(header.len() + c.data.len());
    if zstd {
        // One frame for the header, one per row block (NPYDIR.md §4).
        let z = |b: &[u8]| zstd::bulk::compress(b, ZSTD_LEVEL).map_err(|e| io(&path, e));
        out.extend_from_slice(&z(&header)?);
        for b in &blocks {
            out.extend_from_slice(&z(b)?);
        }
    } else {
        out.extend_from_slice(&header);
        out.extend_from_slice(&c.data);
    }
    std::fs::write(&path, &out).map_err(|e| io(&path, e))?;
    Ok((
        SideFile {
            file: name,
            header_xxh3: Some(hex(xxh3_64(&header))),
            blocks: Some(sums),
            xxh3: None,
        },
        out.len() as u64,
    ))
}

/// `w` rounded to f16: its little-endian bytes and the values they decode to.
fn f16_bytes(w: &[f32]) -> (Vec<u8>, Vec<f32>) {
    let h = le::to_f16s(w);
    (le::le_bytes(&h), h.to_f32_vec())
}

fn encode_one(
    src: &dyn SourceModel,
    i: usize,
    tdir: &Path,
    opts: &NpyOptions,
    passthrough: &Patterns,
) -> Result<Written, ConvertError> {
    let t: &TensorDesc = &src.desc().tensors[i];
    let key = safe_key(&t.name);
    let (rows, cols) = (t.rows() as usize, t.cols() as usize);
    let w = src.f32(i)?;
    let pass = t.shape.len() < 2 || passthrough.is_match(&t.name);
    let finite = w.iter().all(|x| x.is_finite());
    if !pass && !finite {
        tracing::warn!("{}: stored as f16 passthrough (non-finite values)", t.name);
    }
    let int4 = opts.bits == 4 && cols % opts.group == 0 && cols % 2 == 0;
    if !pass && finite && opts.bits == 4 && !int4 {
        tracing::warn!(
            "{}: width {cols} is not a multiple of the group {}: stored as int8",
            t.name,
            opts.group
        );
    }
    let (kind, comps, recon, group): (&str, Vec<Component>, Vec<f32>, Option<u64>) =
        if let SourceType::Plain(p) = t.source {
            // Integers and the like keep their own dtype, bytes as they are.
            let dtype = Dtype::of_plain(p).ok_or_else(|| {
                ConvertError::Options(format!(
                    "tensor {}: an npy-dir cannot hold {p:?} values (numpy has no such dtype); convert to .cawsf instead",
                    t.name
                ))
            })?;
            let c = Component {
                role: "pt",
                suffix: "__pt",
                dtype,
                shape: t.shape.clone(),
                data: src.raw(i)?,
                row_bytes: cols * dtype.size() as usize,
            };
            ("passthrough", vec![c], w.clone(), None)
        } else if pass || !finite {
            let (data, back) = f16_bytes(&w);
            let c = Component {
                role: "pt",
                suffix: "__pt",
                dtype: Dtype::F16,
                shape: t.shape.clone(),
                data,
                row_bytes: cols * 2,
            };
            ("passthrough", vec![c], back, None)
        } else if int4 {
            let (mut p, mut s) = (Vec::new(), Vec::new());
            quant::quantize_int4(&w, cols, opts.group, &mut p, &mut s);
            let mut back = vec![0f32; w.len()];
            let g = cols / opts.group;
            quant::dequantize_int4(&p, &s, cols, g, &mut back);
            let comps = vec![
                Component {
                    role: "q4",
                    suffix: "__q4",
                    dtype: Dtype::U8,
                    shape: vec![rows as u64, cols as u64 / 2],
                    data: p,
                    row_bytes: cols / 2,
                },
                Component {
                    role: "s4",
                    suffix: "__s4",
                    dtype: Dtype::F32,
                    shape: vec![rows as u64, g as u64],
                    data: le::le_bytes(&s),
                    row_bytes: g * 4,
                },
            ];
            ("int4", comps, back, Some(opts.group as u64))
        } else {
            let (mut q, mut s) = (Vec::new(), Vec::new());
            quant::quantize_int8(&w, cols, &mut q, &mut s);
            let qb: Vec<u8> = bytemuck::cast_vec(q);
            let mut back = vec![0f32; w.len()];
            quant::dequantize_int8(&qb, &s, cols, 1, &mut back);
            let comps = vec![
                Component {
                    role: "q",
                    suffix: "__q",
                    dtype: Dtype::I8,
                    shape: vec![rows as u64, cols as u64],
                    data: qb,
                    row_bytes: cols,
                },
                Component {
                    role: "s",
                    suffix: "__s",
                    dtype: Dtype::F32,
                    shape: vec![rows as u64],
                    data: le::le_bytes(&s),
                    row_bytes: 4,
                },
            ];
            ("int8", comps, back, None)
        };
    let comps_dtype = comps[0].dtype;
    let rel_err = quant::rel_err(&w, &recon);
    drop((w, recon));
    let rpb = crate::archive::container::rows_per_block(t) as usize;
    let mut files = BTreeMap::new();
    let mut bytes = 0;
    for c in &comps {
        let (sf, n) = write_component(tdir, &key, c, rpb, opts.zstd)?;
        files.insert(c.role.to_string(), sf);
        bytes += n;
    }
    // The original shape, int64 (as Squish writes it); always plain .npy.
    let mut shape = npy::write_header(Dtype::I64, &[t.shape.len() as u64]);
    let dims: Vec<i64> = t.shape.iter().map(|&d| d as i64).collect();
    le::push_le(&dims, &mut shape);
    let sname = format!("{key}__shape.npy");
    let spath = tdir.join(&sname);
    std::fs::write(&spath, &shape).map_err(|e| io(&spath, e))?;
    bytes += shape.len() as u64;
    files.insert(
        "shape".to_string(),
        SideFile {
            file: sname,
            xxh3: Some(hex(xxh3_64(&shape))),
            ..Default::default()
        },
    );
    let codec = match (kind, opts.zstd) {
        ("int4", z) => format!("int4(g={}){}", opts.group, if z { "+zstd" } else { "" }),
        ("passthrough", z) => format!(
            "passthrough({}){}",
            crate::codec::format_label(comps_dtype.source()),
            if z { "+zstd" } else { "" }
        ),
        (k, z) => format!("{k}{}", if z { "+zstd" } else { "" }),
    };
    Ok(Written {
        side: SideTensor {
            name: t.name.clone(),
            key,
            kind: kind.to_string(),
            rows_per_block: rpb as u64,
            group,
            files,
        },
        report: TensorReport {
            name: t.name.clone(),
            shape: t.shape.clone(),
            codec,
            bytes,
            bits_per_weight: bytes as f64 * 8.0 / t.numel().max(1) as f64,
            rel_err,
        },
        quantized: kind != "passthrough",
    })
}

/// `DIR.tmp`, where the directory is built before it replaces `DIR` (docs/NPYDIR.md):
/// a fixed name, so the next run removes what a crashed one left.
fn tmp_path(out: &Path) -> PathBuf {
    let mut s = out.as_os_str().to_owned();
    s.push(".tmp");
    PathBuf::from(s)
}

/// Convert `src` into an npy-dir at `out`. `progress(done, total, name)` is called after
/// each tensor is written.
pub fn convert(
    src: &dyn SourceModel,
    out: &Path,
    opts: &NpyOptions,
    progress: &(dyn Fn(usize, usize, &str) + Sync),
) -> Result<ConvertReport, ConvertError> {
    if opts.bits != 8 && opts.bits != 4 {
        return Err(ConvertError::Options(format!(
            "--bits {} is not 8 or 4",
            opts.bits
        )));
    }
    if opts.group < 2 || opts.group % 2 != 0 {
        return Err(ConvertError::Options(format!(
            "--group {} is not an even number of at least 2",
            opts.group
        )));
    }
    if out.exists() && !out.join(SIDECAR).is_file() {
        return Err(ConvertError::Options(format!(
            "{} exists and is not an npy-dir written by cawsfs; refusing to replace it",
            out.display()
        )));
    }
    let passthrough = Patterns::new(&opts.passthrough)?;
    let desc = src.desc();
    let mut keys = std::collections::HashSet::new();
    for t in &desc.tensors {
        if !keys.insert(safe_key(&t.name)) {
            return Err(ConvertError::Options(format!(
                "tensor {}: its safe key {} collides with another tensor's",
                t.name,
                safe_key(&t.name)
            )));
        }
    }
    // A fixed name (not a random temp dir): the next run removes what a crashed one left.
    let tmp = tmp_path(out);
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| io(&tmp, e))?;
    }
    let tdir = tmp.join(TENSOR_DIR);
    std::fs::create_dir_all(&tdir).map_err(|e| io(&tdir, e))?;

    let n = desc.tensors.len();
    let mut written = Vec::with_capacity(n);
    crate::convert::in_windows(
        n,
        opts.window,
        |i| encode_one(src, i, &tdir, opts, &passthrough),
        |i, w| {
            written.push(w);
            progress(i + 1, n, &desc.tensors[i].name);
            Ok(())
        },
    )?;

    // Side files for Squish / numpy users (derived for a GGUF source) ...
    let write = |name: &str, bytes: &[u8]| {
        let p = tmp.join(name);
        // A sentence-transformers module's file (`1_Pooling/config.json`).
        if let Some(parent) = p.parent().filter(|d| *d != tmp) {
            std::fs::create_dir_all(parent).map_err(|e| io(parent, e))?;
        }
        std::fs::write(&p, bytes).map_err(|e| io(&p, e))
    };
    for (name, bytes) in crate::layout::hf_metadata_files(desc)
        .map_err(|e| ConvertError::Options(format!("side files: {e}")))?
    {
        write(&name, &bytes)?;
    }
    // ... and the source's own, verbatim, which cawsfs.json names.
    let mut hf_files = BTreeMap::new();
    for (name, bytes) in &desc.hf_files {
        if crate::model::check_hf_file_name(name).is_err()
            || name.starts_with(&format!("{TENSOR_DIR}/"))
            || name == MANIFEST
            || name == SIDECAR
        {
            return Err(ConvertError::Options(format!(
                "side file name {name:?} cannot be stored"
            )));
        }
        write(name, bytes)?;
        hf_files.insert(name.clone(), hex(xxh3_64(bytes)));
    }
    let routing = crate::convert::routing_bytes(src)?;
    let routing_xxh3 = if routing.is_empty() {
        None
    } else {
        write(ROUTING_FILE, &routing)?;
        Some(hex(xxh3_64(&routing)))
    };
    let manifest: serde_json::Map<String, Value> = written
        .iter()
        .map(|w| (w.side.name.clone(), Value::String(w.side.key.clone())))
        .collect();
    let mut mbytes = serde_json::to_vec_pretty(&Value::Object(manifest))
        .map_err(|e| ConvertError::Options(e.to_string()))?;
    mbytes.push(b'\n');
    write(MANIFEST, &mbytes)?;

    let quantized: Vec<bool> = written.iter().map(|w| w.quantized).collect();
    let extra = json!({
        "convert": {
            "bits": opts.bits,
            "group": opts.group,
            "zstd": opts.zstd,
            "passthrough": opts.passthrough,
        },
        "rel_err": written.iter().map(|w| (w.report.name.clone(), json!(w.report.rel_err))).collect::<serde_json::Map<String, Value>>(),
    });
    let (model, _) = crate::archive::container::model_to_meta(desc)
        .map_err(|e| ConvertError::Options(format!("model description: {e}")))?;
    let (reports, sides): (Vec<TensorReport>, Vec<SideTensor>) =
        written.into_iter().map(|w| (w.report, w.side)).unzip();
    let sidecar = Sidecar {
        model,
        hf_files,
        routing_xxh3,
        tensors: sides,
        extra,
    };
    let sbytes = seal_sidecar(&sidecar).map_err(|e| ConvertError::Options(e.to_string()))?;
    write(SIDECAR, &sbytes)?;

    if out.exists() {
        std::fs::remove_dir_all(out).map_err(|e| io(out, e))?;
    }
    std::fs::rename(&tmp, out).map_err(|e| io(out, e))?;
    // Reopening proves the directory reads back.
    crate::archive::npydir::NpyDir::open(out)?;
    let archive_bytes: u64 = walk_size(out).map_err(|e| io(out, e))?;
    Ok(ConvertReport::new(reports, archive_bytes, desc, |i, _| {
        quantized[i]
    }))
}

/// Total size of the regular files under `dir`.
fn walk_size(dir: &Path) -> std::io::Result<u64> {
    let mut total = 0;
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        let ft = e.file_type()?;
        if ft.is_dir() {
            total += walk_size(&e.path())?;
        } else if ft.is_file() {
            total += e.metadata()?.len();
        }
    }
    Ok(total)
}
