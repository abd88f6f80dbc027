//! `cawsfs.json` (docs/NPYDIR.md §5): its types, shared with the writer
//! (`convert::npydir`), and opening a directory cawsfs wrote: the model description,
//! side files and routing checked against their XXH3-64, and every tensor's files
//! checked against the shape, kind, framing and header checksums the sidecar lists.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashSet};
use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::Value;
use xxhash_rust::xxh3::xxh3_64;

use super::files::{header_bytes, read_shape_file, DataFile, Opener};
use super::geometry::{check_quant, Geo, Geometry};
use super::npy::Dtype;
use super::{read_small, Entry, Opened};
use super::{MANIFEST, ROUTING_FILE, SIDECAR, SIDECAR_FORMAT, TENSOR_DIR};
use crate::archive::container::{hex64, invalid, parse_hex64};
use crate::archive::dir::ArchiveDir;
use crate::archive::ArchiveError;
use crate::model::{check_hf_file_name, SourceType, TensorDesc, MAX_HF_FILES};

/// The `cawsfs.json` version this build writes and reads.
pub const SIDECAR_VERSION: u32 = 2;

/// The body of `cawsfs.json` (docs/NPYDIR.md §5), written by `convert::npydir`.
#[derive(Serialize, Deserialize)]
pub struct Sidecar {
    pub model: Value,
    #[serde(default)]
    pub hf_files: BTreeMap<String, String>,
    #[serde(default)]
    pub routing_xxh3: Option<String>,
    pub tensors: Vec<SideTensor>,
    #[serde(default)]
    pub extra: Value,
}

/// What `cawsfs.json` holds: the body as written, and the XXH3-64 of exactly those
/// bytes, so that every byte deciding what is served is covered by a checksum.
#[derive(Serialize, Deserialize)]
struct Envelope<'a> {
    format: Cow<'a, str>,
    version: u32,
    #[serde(default)]
    xxh3: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    body: Option<&'a RawValue>,
}

/// The bytes of `cawsfs.json` for `body` (a [`Sidecar`], or a JSON value in tests).
pub fn seal_sidecar(body: &impl Serialize) -> serde_json::Result<Vec<u8>> {
    let raw = serde_json::value::to_raw_value(body)?;
    serde_json::to_vec(&Envelope {
        format: SIDECAR_FORMAT.into(),
        version: SIDECAR_VERSION,
        xxh3: Some(hex64(xxh3_64(raw.get().as_bytes())).into()),
        body: Some(&raw),
    })
}

/// The body of the `cawsfs.json` at `side`, after its format, version and checksum.
pub(super) fn read_sidecar(src: &ArchiveDir) -> Result<Sidecar, ArchiveError> {
    let side = &src.at(SIDECAR);
    let bytes = read_small(src, SIDECAR)?;
    let env: Envelope = serde_json::from_slice(&bytes)
        .map_err(|e| invalid(side, format!("not a valid cawsfs.json: {e}")))?;
    if env.format != SIDECAR_FORMAT {
        let f = &env.format;
        return Err(invalid(
            side,
            format!("format {f:?} is not {SIDECAR_FORMAT:?}"),
        ));
    }
    match env.version {
        SIDECAR_VERSION => {}
        1 => {
            return Err(invalid(
                side,
                "version 1 carries no checksum of its own and is not read any more; \
                 convert the model again",
            ))
        }
        v => {
            return Err(invalid(
                side,
                format!(
                    "version {v} is not supported (this cawsfs reads version {SIDECAR_VERSION})"
                ),
            ))
        }
    }
    let (Some(sum), Some(body)) = (env.xxh3, env.body) else {
        return Err(invalid(side, "xxh3 or body is missing"));
    };
    if xxh3_64(body.get().as_bytes()) != parse_hex(side, "xxh3", &sum)? {
        return Err(invalid(
            side,
            "body XXH3-64 differs from its xxh3 field (file changed or corrupt)",
        ));
    }
    serde_json::from_str(body.get())
        .map_err(|e| invalid(side, format!("not a valid cawsfs.json body: {e}")))
}

/// One tensor of `cawsfs.json`: its kind, block size and files.
#[derive(Serialize, Deserialize)]
pub struct SideTensor {
    pub name: String,
    pub key: String,
    pub kind: String,
    pub rows_per_block: u64,
    /// Columns per scale (int4; int8 has one scale per row).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<u64>,
    pub files: BTreeMap<String, SideFile>,
}

/// One file of a tensor: its name in `tensors/` and its checksums (per row block for
/// data files, whole-file for the shape file).
#[derive(Serialize, Deserialize, Default)]
pub struct SideFile {
    pub file: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header_xxh3: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blocks: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub xxh3: Option<String>,
}

/// A 16-hex-digit XXH3-64 of `cawsfs.json` (`what` names the field in messages).
fn parse_hex(path: &Path, what: &str, s: &str) -> Result<u64, ArchiveError> {
    parse_hex64(s).ok_or_else(|| invalid(path, format!("{what}: {s:?} is not 16 hex digits")))
}

fn check_sum(
    path: &Path,
    side: &Path,
    what: &str,
    bytes: &[u8],
    want: Option<&str>,
) -> Result<(), ArchiveError> {
    let want = parse_hex(side, what, want.unwrap_or(""))?;
    if xxh3_64(bytes) != want {
        return Err(invalid(
            path,
            format!("{what} XXH3-64 differs from cawsfs.json (file changed or corrupt)"),
        ));
    }
    Ok(())
}

pub(super) fn open_with_sidecar(
    op: &Opener,
    side: &Path,
    manifest: &[(String, String)],
) -> Result<Opened, ArchiveError> {
    let dir = op.dir;
    let sc = read_sidecar(op.src)?;
    let model = serde_json::from_value(sc.model).map_err(|e| format!("model: {e}"));
    let mut model = model
        .and_then(|m| crate::archive::container::model_from_meta(m, BTreeMap::new()))
        .map_err(|e| invalid(side, e))?;
    let mut parts = vec![
        (MANIFEST.to_string(), op.src.len(MANIFEST)),
        (SIDECAR.to_string(), op.src.len(SIDECAR)),
    ];
    if sc.hf_files.len() > MAX_HF_FILES {
        let n = sc.hf_files.len();
        return Err(invalid(
            side,
            format!("hf_files lists {n} files (at most {MAX_HF_FILES})"),
        ));
    }
    for (name, sum) in &sc.hf_files {
        check_hf_file_name(name).map_err(|e| invalid(side, e))?;
        let p = dir.join(name);
        let bytes = read_small(op.src, name)?;
        check_sum(&p, side, "file", &bytes, Some(sum))?;
        parts.push((name.clone(), bytes.len() as u64));
        model.hf_files.insert(name.clone(), bytes);
    }
    let routing = match &sc.routing_xxh3 {
        None => Vec::new(),
        Some(sum) => {
            let p = dir.join(ROUTING_FILE);
            let bytes = read_small(op.src, ROUTING_FILE)?;
            check_sum(&p, side, "file", &bytes, Some(sum))?;
            parts.push((ROUTING_FILE.to_string(), bytes.len() as u64));
            bytes
        }
    };
    if sc.tensors.len() != model.tensors.len() {
        return Err(invalid(
            side,
            format!(
                "{} tensor entries for {} model tensors",
                sc.tensors.len(),
                model.tensors.len()
            ),
        ));
    }
    let listed: HashSet<(&str, &str)> = manifest
        .iter()
        .map(|(a, b)| (a.as_str(), b.as_str()))
        .collect();
    let pairs: Vec<(&SideTensor, &TensorDesc)> = sc.tensors.iter().zip(&model.tensors).collect();
    let entries = op.each(&pairs, |op, (st, t)| {
        open_side_tensor(op, side, &listed, st, t)
    })?;
    Ok(Opened {
        model,
        entries,
        routing,
        extra: sc.extra,
        checksummed: true,
        parts,
    })
}

/// `ArchiveError::Invalid` on `cawsfs.json` about tensor `st`.
fn tensor_err(side: &Path, st: &SideTensor, m: String) -> ArchiveError {
    invalid(side, format!("tensor {}: {m}", st.name))
}

/// The roles of a kind's data files (`[q, s]`, `[q4, s4]` or `[pt]`), its [`Geo`] for
/// width `cols`, and the dtypes each role may have.
type Layout = (&'static [&'static str], Geo, [&'static [Dtype]; 2]);

fn open_side_tensor(
    op: &Opener,
    side: &Path,
    listed: &HashSet<(&str, &str)>,
    st: &SideTensor,
    t: &TensorDesc,
) -> Result<Entry, ArchiveError> {
    let dir = op.dir;
    check_listing(dir, side, listed, st, t)?;
    let sf = side_file(side, st, "shape")?;
    let shape_len = check_shape_file(op, side, st, sf, t)?;
    let (roles, geo, dtypes) = side_layout(side, st, t.cols())?;
    let mut geom = Geometry {
        rows: t.rows(),
        cols: t.cols(),
        rows_per_block: st.rows_per_block,
        geo,
    };
    let mut files = Vec::new();
    let mut stored = shape_len;
    for (idx, role) in roles.iter().enumerate() {
        let df = open_side_data(op, side, st, role, dtypes[idx], idx, &mut geom)?;
        stored += df.file_len;
        files.push(df);
    }
    match geom.geo {
        Geo::Int8 { .. } | Geo::Int4 { .. } => {
            let int4 = matches!(geom.geo, Geo::Int4 { .. });
            if check_quant(dir, t.numel(), &files[0], &files[1], int4)? != geom.geo {
                return Err(tensor_err(
                    side,
                    st,
                    "file shapes do not match the group size in cawsfs.json".into(),
                ));
            }
        }
        Geo::Pt { format } => {
            // A plain tensor's file holds its own type; a float tensor's f16 or f32.
            let fits = match (t.source, format) {
                (SourceType::Plain(_), Some(f)) => f == t.source,
                (_, Some(f)) => f.is_float(),
                (_, None) => false,
            };
            if !fits {
                return Err(invalid(
                    &dir.join(&files[0].rel),
                    format!(
                        "holds {}, not a type tensor {} ({:?}) can be stored in",
                        files[0].header.dtype.descr(),
                        t.name,
                        t.source
                    ),
                ));
            }
            if files[0].header.numel() != t.numel() {
                return Err(invalid(
                    &dir.join(&files[0].rel),
                    format!(
                        "holds {} elements, the tensor {}",
                        files[0].header.numel(),
                        t.numel()
                    ),
                ));
            }
        }
    }
    Ok(Entry {
        geom,
        files,
        stored_bytes: stored,
        shape_part: Some((format!("{TENSOR_DIR}/{}", sf.file), shape_len)),
    })
}

/// The entry names the model's tensor at its position, the manifest maps it to its key,
/// and its block size is usable.
fn check_listing(
    dir: &Path,
    side: &Path,
    listed: &HashSet<(&str, &str)>,
    st: &SideTensor,
    t: &TensorDesc,
) -> Result<(), ArchiveError> {
    if st.name != t.name {
        return Err(tensor_err(
            side,
            st,
            format!("listed where the model has {}", t.name),
        ));
    }
    if !listed.contains(&(st.name.as_str(), st.key.as_str()))
        && !listed.contains(&(st.key.as_str(), st.name.as_str()))
    {
        return Err(invalid(
            &dir.join(MANIFEST),
            format!("does not map tensor {} to {}", st.name, st.key),
        ));
    }
    if st.rows_per_block == 0 {
        return Err(tensor_err(side, st, "rows_per_block is 0".into()));
    }
    Ok(())
}

/// The file of `role`, whose name must be a tensor file of the entry's key.
fn side_file<'a>(
    side: &Path,
    st: &'a SideTensor,
    role: &str,
) -> Result<&'a SideFile, ArchiveError> {
    let f = st
        .files
        .get(role)
        .ok_or_else(|| tensor_err(side, st, format!("no {role:?} file")))?;
    let ok_name = f.file.starts_with(&st.key)
        && !f.file.contains('/')
        && (f.file.ends_with(".npy") || f.file.ends_with(".npy.zst"));
    if !ok_name {
        return Err(tensor_err(
            side,
            st,
            format!(
                "file name {:?} is not a tensor file of key {}",
                f.file, st.key
            ),
        ));
    }
    Ok(f)
}

/// The shape file matches its checksum and the model's shape; returns its length.
fn check_shape_file(
    op: &Opener,
    side: &Path,
    st: &SideTensor,
    sf: &SideFile,
    t: &TensorDesc,
) -> Result<u64, ArchiveError> {
    let (shape, shape_len, shape_sum) = read_shape_file(op, &sf.file)?;
    let shape_path = op.dir.join(TENSOR_DIR).join(&sf.file);
    if Some(hex64(shape_sum).as_str()) != sf.xxh3.as_deref() {
        return Err(invalid(
            &shape_path,
            "XXH3-64 differs from cawsfs.json (file changed or corrupt)",
        ));
    }
    if shape != t.shape {
        return Err(tensor_err(
            side,
            st,
            format!("shape file says {shape:?}, the model {:?}", t.shape),
        ));
    }
    Ok(shape_len)
}

fn side_layout(side: &Path, st: &SideTensor, cols: u64) -> Result<Layout, ArchiveError> {
    Ok(match (st.kind.as_str(), st.group) {
        ("int8", None) => (
            &["q", "s"],
            Geo::Int8 { c: cols, g: 1 },
            [&[Dtype::I8], &[Dtype::F32]],
        ),
        ("int4", Some(gs)) if gs >= 2 && gs % 2 == 0 && cols % gs == 0 => (
            &["q4", "s4"],
            Geo::Int4 {
                c: cols,
                g: cols / gs,
            },
            [&[Dtype::U8], &[Dtype::F32]],
        ),
        ("passthrough", None) => (
            &["pt"],
            // The element type is learnt from the header when the file is opened.
            Geo::Pt { format: None },
            [&Dtype::PASSTHROUGH, &[]],
        ),
        (k, g) => {
            return Err(tensor_err(
                side,
                st,
                format!("kind {k:?} with group {g:?} is not valid for width {cols}"),
            ))
        }
    })
}

/// Opens the data file of `role` (the `idx`-th of the layout) as framed per row block,
/// with its block checksums and its header checked against cawsfs.json.
fn open_side_data(
    op: &Opener,
    side: &Path,
    st: &SideTensor,
    role: &str,
    dtypes: &[Dtype],
    idx: usize,
    geom: &mut Geometry,
) -> Result<DataFile, ArchiveError> {
    let f = side_file(side, st, role)?;
    if let Geo::Pt { format: None } = geom.geo {
        // Learn the passthrough element type from the header before framing.
        let h = op.open(&f.file, dtypes, None)?.header;
        geom.geo = Geo::Pt {
            format: Some(h.dtype.source()),
        };
    }
    let n_blocks = geom.n_blocks();
    // The block count comes from the shape and rows_per_block: it is bounded by the
    // checksums cawsfs.json lists before anything is sized by it.
    let sums = f
        .blocks
        .as_ref()
        .ok_or_else(|| tensor_err(side, st, format!("{role}: no block checksums")))?;
    if sums.len() != n_blocks {
        return Err(tensor_err(
            side,
            st,
            format!(
                "{role}: {} block checksums for {n_blocks} blocks",
                sums.len()
            ),
        ));
    }
    let sums = sums
        .iter()
        .map(|h| parse_hex(side, "blocks", h))
        .collect::<Result<Vec<_>, _>>()?;
    let lens: Vec<u64> = (0..n_blocks)
        .map(|b| {
            let r = geom.block_ranges(b).0[idx];
            r.1 - r.0
        })
        .collect();
    let mut df = op.open(&f.file, dtypes, Some(&lens))?;
    let path = op.dir.join(&df.rel);
    let hb = header_bytes(&df).map_err(|e| invalid(&path, e))?;
    check_sum(&path, side, "npy header", &hb, f.header_xxh3.as_deref())?;
    df.sums = Some(sums);
    Ok(df)
}
