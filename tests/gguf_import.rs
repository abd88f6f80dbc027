//! GGUF reading, writing, dequantization and import checked against the `gguf` Python
//! package (tests/clients/gguf_dequant.py) and the real test model. Not part of plain
//! `cargo test` (it needs both): scripts/test.sh runs it after setup.
//!
//! Dequantization is compared bit for bit: ggml's reference, numpy's vectorized
//! version in `gguf.quants` and ours perform the same float operations in the same
//! order (no fused multiply-add), so every value must have the same bits.

use std::path::{Path, PathBuf};
use std::process::Command;

use cawsfs::gguf::quant::{dequantize, quantize_q8_0};
use cawsfs::gguf::{GgmlType, GgufArray, GgufFile, GgufHeader, GgufValue};
use cawsfs::import::gguf::GgufSource;
use cawsfs::import::SourceModel;
use cawsfs::model::names;

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn python(args: &[&str]) -> String {
    let out = Command::new("python3")
        .arg(repo().join("tests/clients/gguf_dequant.py"))
        .args(args)
        .output()
        .expect("run python3");
    assert!(
        out.status.success(),
        "gguf_dequant.py {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn read_f32(p: &Path) -> Vec<f32> {
    std::fs::read(p)
        .unwrap()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn assert_bits_eq(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        panic!(
            "{what}: element {i} differs: rust {} ({:#010x}) vs gguf {} ({:#010x})",
            got[i],
            got[i].to_bits(),
            want[i],
            want[i].to_bits()
        );
    }
}

fn ty_of(name: &str) -> GgmlType {
    GgmlType::from_name(name).unwrap_or_else(|| panic!("unknown type {name}"))
}

/// Every supported type, random blocks and gguf-quantized ones, dequantized by gguf
/// and by us; the GGUFWriter file that holds them read by our reader.
#[test]
fn dequantize_matches_gguf_python() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let cases = python(&["synth", d]);
    let cases: Vec<&str> = cases.split_whitespace().collect();
    assert!(cases.len() >= 20, "{cases:?}");
    let f = GgufFile::open(&dir.path().join("synth.gguf")).unwrap();
    for case in cases {
        let ty = ty_of(case.trim_end_matches("_q"));
        let blocks = std::fs::read(dir.path().join(format!("{case}.bin"))).unwrap();
        let want = read_f32(&dir.path().join(format!("{case}.f32")));
        let mut got = vec![0f32; want.len()];
        dequantize(ty, &blocks, &mut got).unwrap();
        assert_bits_eq(case, &got, &want);

        let i = f
            .tensors
            .iter()
            .position(|t| t.name == format!("t.{case}"))
            .unwrap();
        assert_eq!(f.tensors[i].ty, ty, "{case}");
        assert_eq!(f.tensors[i].ne, vec![512, 4], "{case}");
        assert_eq!(f.tensor_data(i), &blocks[..], "{case}");
    }
    // Our Q8_0 quantizer produces gguf's (= ggml's reference) bytes.
    let src = read_f32(&dir.path().join("Q8_0_q.src.f32"));
    let mut q = Vec::new();
    quantize_q8_0(&src, &mut q);
    assert_eq!(q, std::fs::read(dir.path().join("Q8_0_q.bin")).unwrap());
}

/// A header written by us (every value type) is accepted by gguf.GGUFReader, which
/// sees the same metadata and tensor layout.
#[test]
fn gguf_python_reads_our_header() {
    let meta = vec![
        (
            "general.architecture".to_string(),
            GgufValue::String("llama".into()),
        ),
        ("t.u8".into(), GgufValue::U8(200)),
        ("t.i8".into(), GgufValue::I8(-100)),
        ("t.u16".into(), GgufValue::U16(60000)),
        ("t.i16".into(), GgufValue::I16(-30000)),
        ("t.u32".into(), GgufValue::U32(4_000_000_000)),
        ("t.i32".into(), GgufValue::I32(-2_000_000_000)),
        ("t.f32".into(), GgufValue::F32(0.5)),
        ("t.bool".into(), GgufValue::Bool(true)),
        ("t.str".into(), GgufValue::String("héllo".into())),
        ("t.u64".into(), GgufValue::U64(1 << 50)),
        ("t.i64".into(), GgufValue::I64(-(1 << 50))),
        ("t.f64".into(), GgufValue::F64(0.25)),
        (
            "t.strs".into(),
            GgufValue::Array(GgufArray::String(vec!["a".to_string(), "bc".into()].into())),
        ),
        (
            "t.i32s".into(),
            GgufValue::Array(GgufArray::I32(vec![-1, 2])),
        ),
        ("t.f32s".into(), GgufValue::Array(GgufArray::F32(vec![]))),
    ];
    let h = GgufHeader::new(
        meta,
        vec![
            ("token_embd.weight".into(), vec![64, 10], GgmlType::Q8_0),
            ("output_norm.weight".into(), vec![64], GgmlType::F32),
            ("blk.0.attn_q.weight".into(), vec![256, 3], GgmlType::Q4_K),
            ("blk.0.attn_k.weight".into(), vec![64, 2], GgmlType::BF16),
        ],
        64,
    );
    let mut bytes = h.to_bytes();
    let data_offset = bytes.len() as u64;
    bytes.resize(bytes.len() + h.data_size() as usize, 0);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ours.gguf");
    std::fs::write(&path, &bytes).unwrap();

    let ours = GgufFile::open(&path).unwrap();
    assert_eq!(ours.meta, h.meta);

    let js: serde_json::Value =
        serde_json::from_str(&python(&["read", path.to_str().unwrap()])).unwrap();
    assert_eq!(js["alignment"], 64);
    let kv = &js["kv"];
    assert_eq!(kv.as_object().unwrap().len(), h.meta.len());
    assert_eq!(kv["t.u8"]["value"], 200);
    assert_eq!(kv["t.i8"]["value"], -100);
    assert_eq!(kv["t.u32"]["value"], 4_000_000_000u64);
    assert_eq!(kv["t.i64"]["value"], -(1i64 << 50));
    assert_eq!(kv["t.f32"]["value"], 0.5);
    assert_eq!(kv["t.bool"]["value"], true);
    assert_eq!(kv["t.str"]["value"], "héllo");
    assert_eq!(kv["t.strs"]["value"], serde_json::json!(["a", "bc"]));
    assert_eq!(kv["t.i32s"]["value"], serde_json::json!([-1, 2]));
    assert_eq!(kv["t.f32s"]["value"], serde_json::json!([]));
    assert_eq!(kv["general.alignment"]["value"], 64);
    assert_eq!(kv["general.alignment"]["type"], serde_json::json!([4]));
    let ts = js["tensors"].as_array().unwrap();
    assert_eq!(ts.len(), 4);
    for (t, e) in ts.iter().zip(&h.tensors) {
        assert_eq!(t["name"], e.name.as_str());
        assert_eq!(t["ne"], serde_json::json!(e.ne));
        assert_eq!(t["type"], e.ty.id());
        assert_eq!(t["offset"], data_offset + e.offset);
        assert_eq!(t["n_bytes"], e.n_bytes);
    }
}

fn real_model() -> PathBuf {
    let out = Command::new("bash")
        .arg(repo().join("scripts/fetch-test-model.sh"))
        .output()
        .expect("run fetch-test-model.sh");
    assert!(
        out.status.success(),
        "fetch-test-model.sh failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

/// Tensors of the real model (Q8_0 embeddings, Q4_1 projections, F32 norms) dequantize
/// exactly as gguf does, and the importer describes the model and undoes the rotary
/// permutation of Q/K rows.
#[test]
fn real_model_matches_gguf_python() {
    let model = real_model();
    let names_ = [
        "token_embd.weight",
        "blk.0.attn_q.weight",
        "blk.0.attn_k.weight",
        "blk.3.ffn_down.weight",
        "output_norm.weight",
    ];
    let dir = tempfile::tempdir().unwrap();
    let mut args = vec![
        "real",
        model.to_str().unwrap(),
        dir.path().to_str().unwrap(),
    ];
    args.extend(names_);
    python(&args);

    let f = GgufFile::open(&model).unwrap();
    for n in names_ {
        let i = f.tensors.iter().position(|t| t.name == n).unwrap();
        let want = read_f32(&dir.path().join(format!("{n}.f32")));
        let mut got = vec![0f32; want.len()];
        dequantize(f.tensors[i].ty, f.tensor_data(i), &mut got).unwrap();
        assert_bits_eq(n, &got, &want);
    }

    // Our reader agrees with gguf.GGUFReader on the real file's layout and metadata.
    let js: serde_json::Value =
        serde_json::from_str(&python(&["read", model.to_str().unwrap()])).unwrap();
    let kv = js["kv"].as_object().unwrap();
    let keys: Vec<&str> = kv.keys().map(|k| k.as_str()).collect();
    let ours: Vec<&str> = f.meta.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(keys, ours);
    for (k, v) in &f.meta {
        let want = &kv[k]["value"];
        match v {
            GgufValue::String(s) => assert_eq!(want, s.as_str(), "{k}"),
            GgufValue::Array(GgufArray::String(a)) => {
                assert_eq!(want, &serde_json::json!(a), "{k}")
            }
            GgufValue::Array(GgufArray::I32(a)) => assert_eq!(want, &serde_json::json!(a), "{k}"),
            GgufValue::Bool(b) => assert_eq!(want, b, "{k}"),
            GgufValue::F32(x) => assert_eq!(want.as_f64().unwrap() as f32, *x, "{k}"),
            other => assert_eq!(want.as_u64(), other.as_u64(), "{k}"),
        }
    }
    let ts = js["tensors"].as_array().unwrap();
    assert_eq!(ts.len(), f.tensors.len());
    for (t, e) in ts.iter().zip(&f.tensors) {
        assert_eq!(t["name"], e.name.as_str());
        assert_eq!(t["ne"], serde_json::json!(e.ne));
        assert_eq!(t["type"], e.ty.id());
        assert_eq!(t["offset"], f.data_offset + e.offset);
        assert_eq!(t["n_bytes"], e.n_bytes);
    }
    // Our writer lays the same tensors out at the same offsets, and its header (which
    // adds general.alignment) reads back to the same metadata.
    let h = GgufHeader::new(
        f.meta.clone(),
        f.tensors
            .iter()
            .map(|t| (t.name.clone(), t.ne.clone(), t.ty))
            .collect(),
        f.alignment,
    );
    for (a, b) in h.tensors.iter().zip(&f.tensors) {
        assert_eq!((a.offset, a.n_bytes), (b.offset, b.n_bytes), "{}", a.name);
    }
    let mut rewritten = h.to_bytes();
    rewritten.resize(rewritten.len() + h.data_size() as usize, 0);
    let p2 = dir.path().join("rewritten.gguf");
    std::fs::write(&p2, &rewritten).unwrap();
    let f2 = GgufFile::open(&p2).unwrap();
    assert_eq!(f2.meta[..f.meta.len()], f.meta[..]);
    assert_eq!(f2.meta.len(), f.meta.len() + 1);

    let src = GgufSource::open(&model).unwrap();
    let d = src.desc();
    let a = &d.arch;
    assert_eq!(a.model_type, "llama");
    assert_eq!(a.gguf_arch.as_deref(), Some("llama"));
    assert_eq!(
        (
            a.n_layers,
            a.hidden_size,
            a.n_heads,
            a.n_kv_heads,
            a.intermediate_size
        ),
        (30, 576, 9, 3, 1536)
    );
    assert_eq!(
        (a.head_dim, a.vocab_size, a.context_length),
        (64, 49152, 8192)
    );
    assert!(a.tie_word_embeddings);
    assert_eq!(a.rope_theta, 100000.0);
    assert_eq!(a.rms_norm_eps, 1e-5);
    assert_eq!(
        (a.bos_token_id, a.eos_token_id, a.pad_token_id),
        (Some(1), Some(2), Some(2))
    );
    assert_eq!(d.tensors.len(), f.tensors.len());
    assert_eq!(d.gguf_meta, f.meta);
    assert!(d.hf_files.is_empty());
    assert!(d.tensor_index("lm_head.weight").is_none());

    let emb = d.tensor_index("model.embed_tokens.weight").unwrap();
    assert_eq!(d.tensors[emb].shape, vec![49152, 576]);
    assert_bits_eq(
        "embed_tokens",
        &src.f32(emb).unwrap(),
        &read_f32(&dir.path().join("token_embd.weight.f32")),
    );
    let norm = d.tensor_index("model.norm.weight").unwrap();
    assert_eq!(d.tensors[norm].shape, vec![576]);
    let down = d
        .tensor_index("model.layers.3.mlp.down_proj.weight")
        .unwrap();
    assert_eq!(d.tensors[down].shape, vec![576, 1536]);
    assert_bits_eq(
        "down_proj",
        &src.f32(down).unwrap(),
        &read_f32(&dir.path().join("blk.3.ffn_down.weight.f32")),
    );

    for (hf, gg, rows, heads) in [
        (
            "model.layers.0.self_attn.q_proj.weight",
            "blk.0.attn_q.weight",
            576u64,
            9u32,
        ),
        (
            "model.layers.0.self_attn.k_proj.weight",
            "blk.0.attn_k.weight",
            192,
            3,
        ),
    ] {
        let i = d.tensor_index(hf).unwrap();
        assert_eq!(d.tensors[i].shape, vec![rows, 576]);
        let got = src.f32(i).unwrap();
        let gguf_rows = read_f32(&dir.path().join(format!("{gg}.f32")));
        let mut want = vec![0f32; gguf_rows.len()];
        for r in 0..rows {
            let g = names::hf_row_to_gguf(r, rows, heads) as usize;
            want[r as usize * 576..][..576].copy_from_slice(&gguf_rows[g * 576..][..576]);
        }
        assert_bits_eq(hf, &got, &want);
        // raw() reorders the quantized rows the same way.
        let raw = src.raw(i).unwrap();
        let mut deq = vec![0f32; want.len()];
        dequantize(GgmlType::Q4_1, &raw, &mut deq).unwrap();
        assert_bits_eq(hf, &deq, &want);
    }
}
