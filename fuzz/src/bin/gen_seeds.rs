//! Writes the seed corpus of every fuzz target into `OUT/<target>/`:
//!
//!     gen_seeds OUT
//!
//! The archives are real: the tiny model (`cawsfs_fuzz::tiny`) converted by the
//! converters themselves (`.cawsf` three ways, delta two ways, npy-dir three ways), and
//! the GGUF and safetensors files are what the layouts serve for them. Each seed that a
//! parser should accept is checked to open, so a seed corpus never silently degrades to
//! "all rejected at the magic".

use std::path::{Path, PathBuf};

use cawsfs::archive::{Compression, Store};
use cawsfs::codec::delta::{BaseDtype, RankChoice};
use cawsfs::convert::delta::DeltaOptions;
use cawsfs::convert::npydir::NpyOptions;
use cawsfs::convert::ConvertOptions;
use cawsfs::gguf::writer::GgufHeader;
use cawsfs::gguf::{quant, GgmlType};
use cawsfs::layout::{self, GgufView, VirtualFile};
use cawsfs::model::FloatType;
use cawsfs_fuzz::tiny::{self, Rng};
use cawsfs_fuzz::{encode_files, FILE_SEP};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn main() -> Res<()> {
    let out = PathBuf::from(std::env::args().nth(1).ok_or("usage: gen_seeds OUT_DIR")?);
    let work = tempfile::tempdir()?;
    let hf = work.path().join("hf");
    tiny::write_hf_dir(&hf)?;
    let src = cawsfs::import::open_source(&hf)?;
    let seeds = Seeds { out: out.clone() };
    let nothing = |_: usize, _: usize, _: &str| {};

    // .cawsf: default codecs, another NDSQ/PQ setting with lz4, scalar R, exact passthrough.
    let mut small = ConvertOptions::default();
    small.ndsq.rank = 4;
    small.ndsq.pq_k = 16;
    let mut lz4 = small.clone();
    lz4.compression = Compression::Lz4;
    lz4.ndsq.rank = 2;
    lz4.ndsq.pq_dim = 4;
    lz4.ndsq.outlier_q = 0.99;
    // R as 3-bit scalar groups, stored uncompressed so mutations reach its parser.
    let mut sq = small.clone();
    sq.compression = Compression::None;
    sq.ndsq.rank = 2;
    sq.ndsq.outlier_q = 0.99;
    sq.ndsq.sq = Some(cawsfs::codec::SqParams { bits: 3, group: 16 });
    let mut exact = small.clone();
    exact.compression = Compression::None;
    exact.passthrough = vec!["*".into()];
    let mut first: Option<PathBuf> = None;
    for (name, opts) in [
        ("default", &small),
        ("lz4", &lz4),
        ("sq", &sq),
        ("exact", &exact),
    ] {
        let p = work.path().join(format!("{name}.cawsf"));
        cawsfs::convert::convert(src.as_ref(), &p, opts, &nothing)?;
        seeds.file_checked("cawsf", &format!("{name}.cawsf"), &p)?;
        first.get_or_insert(p);
    }

    // Delta: f16 base with a fixed rank; two int8 bases, lz4.
    let f16 = DeltaOptions {
        rank: RankChoice::Fixed(4),
        ..DeltaOptions::default()
    };
    let int8 = DeltaOptions {
        rank: RankChoice::Fixed(2),
        bases: 2,
        base_dtype: BaseDtype::Int8,
        compression: Compression::Lz4,
        ..DeltaOptions::default()
    };
    for (name, opts) in [("f16", &f16), ("int8", &int8)] {
        let p = work.path().join(format!("{name}.cawsfd"));
        cawsfs::convert::delta::convert(src.as_ref(), &p, opts, &nothing)?;
        seeds.file_checked("delta", &format!("{name}.cawsfd"), &p)?;
    }

    // npy-dir: int8, int4 in framed .npy.zst, int8 in .npy.zst; each also without
    // cawsfs.json (the foreign-directory reader).
    let variants = [
        ("int8", NpyOptions::default()),
        (
            "int4-zstd",
            NpyOptions {
                bits: 4,
                group: 16,
                zstd: true,
                ..NpyOptions::default()
            },
        ),
        (
            "int8-zstd",
            NpyOptions {
                zstd: true,
                ..NpyOptions::default()
            },
        ),
    ];
    for (name, opts) in variants {
        let d = work.path().join(format!("{name}.npydir"));
        cawsfs::convert::npydir::convert(src.as_ref(), &d, &opts, &nothing)?;
        let store = cawsfs::archive::open(&d)?;
        seeds.bytes(
            "routing",
            &format!("{name}-npydir.bin"),
            store.routing_bytes(),
        )?;
        let files = dir_files(&d)?;
        seeds.bytes("npydir", name, &encode_files(&files))?;
        let foreign: Vec<_> = files
            .iter()
            .filter(|(n, _)| n != "cawsfs.json")
            .cloned()
            .collect();
        seeds.bytes(
            "npydir",
            &format!("{name}-foreign"),
            &encode_files(&foreign),
        )?;
        for (n, bytes) in &files {
            if let Ok(len) = cawsfs::archive::npydir::npy::header_len(bytes) {
                let end = (len as usize + 8).min(bytes.len());
                let stem = n.rsplit('/').next().unwrap_or(n);
                seeds.bytes("npy_header", &format!("{name}-{stem}"), &bytes[..end])?;
            }
        }
    }

    // Virtual files of the first archive: GGUF in each float type and the default
    // (quantized) view, safetensors.
    let store = cawsfs::archive::open(first.as_ref().unwrap())?;
    let model = store.model();
    seeds.bytes("routing", "cawsf.bin", store.routing_bytes())?;
    let mut f16_gguf = Vec::new();
    let held = layout::held_of(store.as_ref());
    for (name, view) in [
        ("f16", GgufView::Type(GgmlType::F16)),
        ("f32", GgufView::Type(GgmlType::F32)),
        ("bf16", GgufView::Type(GgmlType::BF16)),
        ("auto", GgufView::Auto),
    ] {
        let plan = layout::gguf_plan(model, view, &held)?;
        let bytes = read_all(&layout::gguf_file(model, &plan)?, store.as_ref())?;
        let p = seeds.bytes("gguf", &format!("{name}.gguf"), &bytes)?;
        cawsfs::import::open_source(&p)?;
        if name == "f16" {
            f16_gguf = bytes;
        }
    }
    for (name, bytes) in quantized_ggufs(&f16_gguf)? {
        let p = seeds.bytes("gguf", &name, &bytes)?;
        if let Err(e) = cawsfs::import::open_source(&p) {
            eprintln!("note: seed gguf/{name} does not import: {e}");
        }
    }
    seeds.bytes("safetensors", "source", &tiny::safetensors_bytes())?;
    let st = read_all(
        &layout::safetensors_file(model, Some(FloatType::BF16))?,
        store.as_ref(),
    )?;
    seeds.bytes("safetensors", "bf16", &st)?;

    // Hugging Face JSON: the tiny model's files, the same with a shard index, and the
    // files a GGUF source derives (tokenizer.json from GGUF vocabulary and merges).
    let json = tiny::json_files();
    seeds.bytes("hf_json", "tiny", &encode_files(&json))?;
    let mut sharded = json.clone();
    let names: serde_json::Map<String, serde_json::Value> = tiny::tensor_shapes()
        .into_iter()
        .map(|(n, _)| (n, "model.safetensors".into()))
        .collect();
    let index = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": names});
    sharded.push((
        "model.safetensors.index.json".into(),
        serde_json::to_vec(&index)?,
    ));
    seeds.bytes("hf_json", "sharded", &encode_files(&sharded))?;
    let gguf_src = cawsfs::import::open_source(&out.join("gguf/f16.gguf"))?;
    let derived = layout::hf_metadata_files(gguf_src.desc())?;
    seeds.bytes("hf_json", "from-gguf", &encode_files(&derived))?;

    // Control protocol: one request line of each verb and form, and replies.
    let lines: &[&str] = &[
        r#"{"verb":"ping"}"#,
        r#"{"verb":"stat"}"#,
        r#"{"verb":"prefetch","file":"model.gguf","range":[0,4096]}"#,
        r#"{"verb":"prefetch","tensor":"model.layers.0.mlp.up_proj.weight"}"#,
        r#"{"verb":"pin","layer":1}"#,
        r#"{"verb":"unpin","file":"model.safetensors"}"#,
        r#"{"verb":"evict"}"#,
        r#"{"verb":"evict","layer":0}"#,
        r#"{"verb":"trace","on":true}"#,
        r#"{"verb":"route","prompt":"the capital of France","top_k":4,"budget_bytes":1048576,"prefetch":true,"file":"model.gguf"}"#,
        r#"{"ok":true,"pong":true,"version":"0.1.0","pid":12}"#,
        r#"{"ok":false,"error":"no such file: x"}"#,
    ];
    for (i, l) in lines.iter().enumerate() {
        seeds.bytes("control", &format!("line{i:02}"), l.as_bytes())?;
    }
    // A real stat reply, as the daemon writes it, when the daemon's defaults make one.
    let stat = serde_json::to_value(cawsfs::control::reply::StatReply::default())?;
    let mut reply = stat.as_object().cloned().unwrap_or_default();
    reply.insert("ok".into(), true.into());
    seeds.bytes("control", "stat", serde_json::to_string(&reply)?.as_bytes())?;

    // Importance matrices of the tiny model, in llama.cpp's two formats; each must parse.
    for (name, bytes) in imatrix_seeds(src.desc())? {
        let p = seeds.bytes("imatrix", name, &bytes)?;
        cawsfs::import::imatrix::Imatrix::parse(&bytes)
            .map_err(|e| format!("{}: {e}", p.display()))?;
    }

    for t in cawsfs_fuzz::TARGETS {
        let n = cawsfs_fuzz::seed_files(&out, t).len();
        let bytes: u64 = cawsfs_fuzz::seed_files(&out, t)
            .iter()
            .map(|p| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0))
            .sum();
        println!("{t:12} {n:3} seeds {bytes:8} bytes");
    }
    Ok(())
}

/// A legacy (.dat) and a GGUF importance matrix with an entry per 2-D tensor of `desc`
/// that llama.cpp names, as `llama-imatrix` writes them (docs/IMATRIX.md).
fn imatrix_seeds(desc: &cawsfs::model::ModelDesc) -> Res<Vec<(&'static str, Vec<u8>)>> {
    use cawsfs::gguf::GgufValue;
    let entries: Vec<(String, Vec<f32>)> = desc
        .tensors
        .iter()
        .filter(|t| t.shape.len() == 2)
        .filter_map(|t| cawsfs::model::names::hf_to_gguf(&t.name).map(|g| (g, t.cols())))
        .map(|(g, cols)| (g, (0..cols).map(|j| (j % 5) as f32 + 0.5).collect()))
        .collect();
    let mut dat = (entries.len() as i32).to_le_bytes().to_vec();
    for (name, v) in &entries {
        dat.extend((name.len() as i32).to_le_bytes());
        dat.extend(name.as_bytes());
        dat.extend(2i32.to_le_bytes());
        dat.extend((v.len() as i32).to_le_bytes());
        v.iter().for_each(|x| dat.extend((x * 2.0).to_le_bytes()));
    }
    dat.extend(4i32.to_le_bytes());
    dat.extend(8i32.to_le_bytes());
    dat.extend(b"calib.tx");
    let mut tensors = Vec::new();
    let mut data: Vec<Vec<f32>> = Vec::new();
    for (name, v) in &entries {
        tensors.push((
            format!("{name}.in_sum2"),
            vec![v.len() as u64, 1],
            GgmlType::F32,
        ));
        data.push(v.iter().map(|x| x * 3.0).collect());
        tensors.push((format!("{name}.counts"), vec![1, 1], GgmlType::F32));
        data.push(vec![3.0]);
    }
    let h = GgufHeader::try_new(
        vec![
            ("general.type".into(), GgufValue::String("imatrix".into())),
            ("imatrix.chunk_count".into(), GgufValue::U32(4)),
        ],
        tensors,
        32,
    )?;
    let mut gguf = h.to_bytes();
    let base = gguf.len();
    gguf.resize(base + h.data_size() as usize, 0);
    for (t, v) in h.tensors.iter().zip(&data) {
        let at = base + t.offset as usize;
        for (k, x) in v.iter().enumerate() {
            gguf[at + 4 * k..at + 4 * k + 4].copy_from_slice(&x.to_le_bytes());
        }
    }
    Ok(vec![("legacy.dat", dat), ("imatrix.gguf", gguf)])
}

struct Seeds {
    out: PathBuf,
}

impl Seeds {
    fn bytes(&self, target: &str, name: &str, data: &[u8]) -> Res<PathBuf> {
        let dir = self.out.join(target);
        std::fs::create_dir_all(&dir)?;
        let p = dir.join(name);
        std::fs::write(&p, data)?;
        Ok(p)
    }

    /// Copy an archive file in, after checking that the seed opens and reads.
    fn file_checked(&self, target: &str, name: &str, path: &Path) -> Res<()> {
        let data = std::fs::read(path)?;
        let p = self.bytes(target, name, &data)?;
        let store = cawsfs::archive::open(&p)?;
        if let Some(e) = store.verify_all().first() {
            return Err(format!("seed {target}/{name} does not verify: {e}").into());
        }
        Ok(())
    }
}

/// Every file under `dir` as (relative name, bytes), sorted.
fn dir_files(dir: &Path) -> Res<Vec<(String, Vec<u8>)>> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d)? {
            let p = e?.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                let rel = p.strip_prefix(dir)?.to_string_lossy().into_owned();
                let bytes = std::fs::read(&p)?;
                if bytes.windows(FILE_SEP.len()).any(|w| w == FILE_SEP) {
                    return Err(format!("{rel} holds the file separator").into());
                }
                out.push((rel, bytes));
            }
        }
    }
    out.sort();
    Ok(out)
}

fn read_all(vf: &VirtualFile, src: &dyn Store) -> Res<Vec<u8>> {
    let mut buf = vec![0u8; vf.size as usize];
    let n = vf.read_at(src, 0, &mut buf)?;
    buf.truncate(n);
    Ok(buf)
}

/// GGUF files with quantized tensors (the dequantizers are decode paths of the GGUF
/// importer): the f16 file's metadata with its 2-D tensors in each 32-wide block type,
/// and one file of 256-wide tensors in each k-quant type. Tensor data is seeded random
/// bytes (any bytes are valid blocks).
fn quantized_ggufs(f16_gguf: &[u8]) -> Res<Vec<(String, Vec<u8>)>> {
    let h = cawsfs::gguf::reader::parse_header(f16_gguf)?;
    let small = [
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q8_1,
    ];
    let k = [
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::Q8_K,
    ];
    let mut rng = Rng::new(7);
    let mut build = |tensors: Vec<(String, Vec<u64>, GgmlType)>| -> Res<Vec<u8>> {
        let header = GgufHeader::try_new(h.meta.clone(), tensors, 32)?;
        let mut bytes = header.to_bytes();
        for _ in 0..header.data_size() {
            bytes.push(rng.next_u64() as u8);
        }
        Ok(bytes)
    };
    let mut out = Vec::new();
    let mut i = 0;
    let blocks: Vec<(String, Vec<u64>, GgmlType)> = h
        .tensors
        .iter()
        .map(|t| {
            let ty = if t.ne.len() == 2 {
                i += 1;
                small[i % small.len()]
            } else {
                t.ty
            };
            (t.name.clone(), t.ne.clone(), ty)
        })
        .filter(|(_, _, ty)| quant::is_supported(*ty))
        .collect();
    out.push(("q-blocks.gguf".to_string(), build(blocks)?));
    let kq: Vec<(String, Vec<u64>, GgmlType)> = k
        .iter()
        .filter(|ty| quant::is_supported(**ty))
        .enumerate()
        .map(|(j, &ty)| {
            (
                format!("blk.{}.ffn_up.weight", j),
                vec![256, 2 + j as u64],
                ty,
            )
        })
        .collect();
    out.push(("q-k.gguf".to_string(), build(kq)?));
    Ok(out)
}
