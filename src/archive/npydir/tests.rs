//! npy-dir round trips, foreign (Squish-written) directories, and bad input: corrupt,
//! truncated or malformed files give errors, never panics or wrong values.

use std::collections::BTreeMap;
use std::path::Path;

use super::npy::{write_header, Dtype};
use super::*;
use crate::convert::npydir::{convert, NpyOptions};
use crate::model::ArchConfig;
use crate::test_support::{self, f32_tensor, read_all, tiny_arch, MemSource};

const CONFIG: &str = r#"{"model_type": "llama", "hidden_size": 128, "num_attention_heads": 2,
 "num_hidden_layers": 1, "intermediate_size": 96, "vocab_size": 300, "num_key_value_heads": 1}"#;

fn source() -> MemSource {
    let tensors = vec![
        // 300 × 128: several row blocks (rows_per_block = 256).
        f32_tensor("model.embed_tokens.weight", &[300, 128]),
        f32_tensor("model.layers.0.self_attn.q_proj.weight", &[300, 128]),
        // Width 96 is not a multiple of the group: int8 even with --bits 4.
        f32_tensor("model.layers.0.mlp.down_proj.weight", &[128, 96]),
        f32_tensor("model.norm.weight", &[128]),
    ];
    let mut x = 12345u32;
    let data = tensors
        .iter()
        .map(|d| {
            (0..d.numel())
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 17;
                    x ^= x << 5;
                    (x as f32 / u32::MAX as f32 - 0.5) * 0.1
                })
                .collect()
        })
        .collect();
    let mut hf_files = BTreeMap::new();
    hf_files.insert("config.json".to_string(), CONFIG.as_bytes().to_vec());
    let arch = ArchConfig {
        hidden_size: 128,
        intermediate_size: 96,
        head_dim: 64,
        vocab_size: 300,
        tie_word_embeddings: true,
        bos_token_id: None,
        eos_token_id: None,
        ..tiny_arch()
    };
    MemSource {
        desc: ModelDesc {
            hf_files,
            ..test_support::model(arch, tensors)
        },
        data,
    }
}

fn write(src: &MemSource, dir: &Path, bits: u8, zstd: bool) -> crate::convert::ConvertReport {
    let opts = NpyOptions {
        bits,
        zstd,
        ..Default::default()
    };
    convert(src, dir, &opts, &|_, _, _| {}).unwrap()
}

fn file_bytes(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    for sub in ["", TENSOR_DIR] {
        for e in std::fs::read_dir(dir.join(sub)).unwrap() {
            let e = e.unwrap();
            if e.file_type().unwrap().is_file() {
                out.insert(
                    format!("{sub}/{}", e.file_name().to_string_lossy()),
                    std::fs::read(e.path()).unwrap(),
                );
            }
        }
    }
    out
}

#[test]
fn roundtrip_all_kinds() {
    let src = source();
    let tmp = tempfile::tempdir().unwrap();
    for (bits, zstd, tol) in [
        (8, false, 0.02),
        (4, false, 0.2),
        (4, true, 0.2),
        (8, true, 0.02),
    ] {
        let dir = tmp.path().join(format!("d{bits}{zstd}"));
        let rep = write(&src, &dir, bits, zstd);
        let d = NpyDir::open(&dir).unwrap();
        assert!(d.checksummed());
        assert_eq!(d.model(), &src.desc);
        assert!(d.verify_all().is_empty(), "{:?}", d.verify_all());
        let kinds: Vec<String> = (0..4).map(|i| d.tensor_summary(i).codec).collect();
        let z = if zstd { "+zstd" } else { "" };
        let q = if bits == 4 {
            format!("int4(g=64){z}")
        } else {
            format!("int8{z}")
        };
        assert_eq!(
            kinds,
            vec![
                format!("passthrough(f16){z}"),
                q,
                format!("int8{z}"),
                format!("passthrough(f16){z}")
            ]
        );
        for t in 0..4 {
            let full = read_all(&d, t).unwrap();
            let err = crate::codec::intq::rel_err(&src.data[t], &full);
            assert!(err < tol, "{t}: {err}");
            assert!((err - rep.tensors[t].rel_err).abs() < 1e-9);
            assert_eq!(d.tensor_summary(t).rel_err, Some(rep.tensors[t].rel_err));
            // Any row range equals the same rows of a full read.
            let td = &d.model().tensors[t];
            let cols = td.cols() as usize;
            for (r0, r1) in [
                (0, 1),
                (255, 257),
                (1, td.rows()),
                (td.rows() - 1, td.rows()),
            ] {
                let (r0, r1) = (r0.min(td.rows()), r1.min(td.rows()));
                let mut out = vec![0f32; (r1 - r0) as usize * cols];
                d.read_rows(t, r0, r1, &mut out).unwrap();
                assert_eq!(out, full[r0 as usize * cols..r1 as usize * cols]);
            }
        }
        let mut out = vec![0f32; 128];
        assert!(matches!(
            d.read_rows(0, 300, 301, &mut out),
            Err(ReadError::OutOfRange { .. })
        ));
        // Deterministic: the same input gives the same bytes.
        let again = tmp.path().join("again");
        write(&src, &again, bits, zstd);
        assert_eq!(file_bytes(&dir), file_bytes(&again));
    }
}

#[test]
fn corrupt_block_fails_only_its_reads() {
    let src = source();
    let tmp = tempfile::tempdir().unwrap();
    for zstd in [false, true] {
        let dir = tmp.path().join(format!("c{zstd}"));
        write(&src, &dir, 8, zstd);
        let key = safe_key("model.layers.0.self_attn.q_proj.weight");
        let p = dir
            .join(TENSOR_DIR)
            .join(format!("{key}__q.npy{}", if zstd { ".zst" } else { "" }));
        let mut b = std::fs::read(&p).unwrap();
        let pos = b.len() - 40; // inside the last row block
        b[pos] ^= 0x55;
        std::fs::write(&p, &b).unwrap();
        let d = NpyDir::open(&dir).unwrap();
        let fails = d.verify_all();
        assert_eq!(fails.len(), 1, "{fails:?}");
        assert!(
            fails[0].contains(&key) && fails[0].contains("q_proj") && fails[0].contains("block 1"),
            "{fails:?}"
        );
        let mut out = vec![0f32; 128];
        assert!(d.read_rows(1, 299, 300, &mut out).is_err());
        assert!(d.read_rows(1, 0, 1, &mut out).is_ok());
        assert!(read_all(&d, 0).is_ok());
    }
}

#[test]
fn bad_files_are_errors_at_open() {
    let src = source();
    let tmp = tempfile::tempdir().unwrap();
    let base = tmp.path().join("base");
    write(&src, &base, 4, false);
    let zbase = tmp.path().join("zbase");
    write(&src, &zbase, 4, true);
    let key = safe_key("model.layers.0.self_attn.q_proj.weight");
    type Edit = Box<dyn Fn(&mut Vec<u8>)>;
    let cases: Vec<(&Path, String, Edit, &str)> = vec![
        (
            &base,
            format!("{key}__q4.npy"),
            Box::new(|b| b.truncate(b.len() - 1)),
            "truncated",
        ),
        (
            &base,
            format!("{key}__q4.npy"),
            Box::new(|b| b.push(0)),
            "trailing",
        ),
        (
            &base,
            format!("{key}__s4.npy"),
            Box::new(|b| b.truncate(20)),
            "truncated",
        ),
        (
            &base,
            format!("{key}__q4.npy"),
            Box::new(|b| {
                let (from, to) = (b"'fortran_order': False", b"'fortran_order': True ");
                let at = b.windows(from.len()).position(|w| w == from).unwrap();
                b[at..at + to.len()].copy_from_slice(to);
            }),
            "Fortran",
        ),
        (
            &base,
            format!("{key}__q4.npy"),
            Box::new(|b| b[0] = b'X'),
            "magic",
        ),
        (
            &base,
            format!("{key}__q4.npy"),
            Box::new(|b| b.clear()),
            "empty",
        ),
        (
            &zbase,
            format!("{key}__q4.npy.zst"),
            Box::new(|b| b.truncate(b.len() - 3)),
            "zstd",
        ),
        (
            &zbase,
            format!("{key}__q4.npy.zst"),
            Box::new(|b| b.truncate(b.len() / 2)),
            "zstd",
        ),
    ];
    for (i, (from, file, edit, want)) in cases.into_iter().enumerate() {
        let dir = tmp.path().join(format!("case{i}"));
        copy_dir(from, &dir);
        let p = dir.join(TENSOR_DIR).join(&file);
        let mut b = std::fs::read(&p).unwrap();
        edit(&mut b);
        std::fs::write(&p, &b).unwrap();
        let e = NpyDir::open(&dir)
            .err()
            .unwrap_or_else(|| panic!("case {i} opened"))
            .to_string();
        assert!(e.contains(&file) && e.contains(want), "case {i}: {e}");
        assert_eq!(e.lines().count(), 1, "{e}");
    }
    // Manifest and sidecar damage.
    for (name, content, want) in [
        (MANIFEST, "{not json", "not valid JSON"),
        (MANIFEST, "[1, 2]", "not a JSON object"),
        (MANIFEST, "{}", "lists no tensors"),
        (MANIFEST, "{\"a\": 3}", "not a pair"),
        (SIDECAR, "{\"format\": \"x\"}", "not a valid cawsfs.json"),
    ] {
        let dir = tmp.path().join("m");
        let _ = std::fs::remove_dir_all(&dir);
        copy_dir(&base, &dir);
        std::fs::write(dir.join(name), content).unwrap();
        let e = NpyDir::open(&dir).err().expect("opened").to_string();
        assert!(e.contains(name) && e.contains(want), "{e}");
    }
}

#[test]
fn every_truncation_and_flip_is_handled() {
    let src = source();
    let tmp = tempfile::tempdir().unwrap();
    for zstd in [false, true] {
        let base = tmp.path().join(format!("b{zstd}"));
        write(&src, &base, 4, zstd);
        let files: Vec<String> = std::fs::read_dir(base.join(TENSOR_DIR))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.contains("q_proj"))
            .collect();
        for f in files {
            let orig = std::fs::read(base.join(TENSOR_DIR).join(&f)).unwrap();
            let dir = tmp.path().join("t");
            let _ = std::fs::remove_dir_all(&dir);
            copy_dir(&base, &dir);
            let p = dir.join(TENSOR_DIR).join(&f);
            let step = (orig.len() / 37).max(1);
            for cut in (0..orig.len()).step_by(step) {
                std::fs::write(&p, &orig[..cut]).unwrap();
                assert!(NpyDir::open(&dir).is_err(), "{f} cut at {cut} opened");
            }
            for pos in (0..orig.len()).step_by(step) {
                let mut b = orig.clone();
                b[pos] ^= 0xA5;
                std::fs::write(&p, &b).unwrap();
                // Either open fails or reading the tensor fails (a flipped data byte
                // is caught by its block checksum); never a panic or wrong values.
                if let Ok(d) = NpyDir::open(&dir) {
                    let ok = read_all(&d, 1).is_ok();
                    assert!(!ok, "{f} flip at {pos} read without error");
                    assert!(!d.verify_all().is_empty(), "{f} flip at {pos} verified");
                }
            }
        }
    }
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to.join(TENSOR_DIR)).unwrap();
    for sub in ["", TENSOR_DIR] {
        for e in std::fs::read_dir(from.join(sub)).unwrap() {
            let e = e.unwrap();
            if e.file_type().unwrap().is_file() {
                std::fs::copy(e.path(), to.join(sub).join(e.file_name())).unwrap();
            }
        }
    }
}

fn npy(dir: &Path, name: &str, dt: Dtype, shape: &[u64], data: &[u8]) {
    let mut b = write_header(dt, shape);
    b.extend_from_slice(data);
    std::fs::write(dir.join(TENSOR_DIR).join(name), b).unwrap();
}

fn shape_file(dir: &Path, key: &str, shape: &[u64]) {
    let data: Vec<u8> = shape
        .iter()
        .flat_map(|&d| (d as i64).to_le_bytes())
        .collect();
    npy(
        dir,
        &format!("{key}__shape.npy"),
        Dtype::I64,
        &[shape.len() as u64],
        &data,
    );
}

/// A directory as Squish writes it: no cawsfs.json, manifest name → key.
#[test]
fn foreign_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("sq");
    std::fs::create_dir_all(dir.join(TENSOR_DIR)).unwrap();
    std::fs::write(dir.join("config.json"), CONFIG).unwrap();
    let names = [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.norm.weight",
    ];
    let manifest: serde_json::Map<String, Value> = names
        .iter()
        .map(|n| (n.to_string(), Value::String(safe_key(n))))
        .collect();
    std::fs::write(dir.join(MANIFEST), serde_json::to_vec(&manifest).unwrap()).unwrap();
    // Embedding: int8 with per-row scales, as a single-frame .npy.zst.
    let k0 = safe_key(names[0]);
    let q: Vec<u8> = (0..300 * 128)
        .map(|i: i32| (i % 255 - 127) as i8 as u8)
        .collect();
    let s: Vec<u8> = (0..300)
        .flat_map(|r| (0.01f32 * (r + 1) as f32).to_le_bytes())
        .collect();
    npy(&dir, &format!("{k0}__q.npy"), Dtype::I8, &[300, 128], &q);
    let plain = std::fs::read(dir.join(TENSOR_DIR).join(format!("{k0}__q.npy"))).unwrap();
    std::fs::write(
        dir.join(TENSOR_DIR).join(format!("{k0}__q.npy.zst")),
        zstd::bulk::compress(&plain, 3).unwrap(),
    )
    .unwrap();
    std::fs::remove_file(dir.join(TENSOR_DIR).join(format!("{k0}__q.npy"))).unwrap();
    npy(&dir, &format!("{k0}__s.npy"), Dtype::F32, &[300], &s);
    shape_file(&dir, &k0, &[300, 128]);
    // q_proj: both int8 and int4 present: int4 wins. Nibbles: low = even column.
    let k1 = safe_key(names[1]);
    npy(
        &dir,
        &format!("{k1}__q.npy"),
        Dtype::I8,
        &[300, 128],
        &vec![0; 300 * 128],
    );
    npy(
        &dir,
        &format!("{k1}__s.npy"),
        Dtype::F32,
        &[300],
        &vec![0; 300 * 4],
    );
    let p: Vec<u8> = (0..300 * 64)
        .map(|i| if i % 64 == 0 { 0x9E } else { 0x77 })
        .collect();
    let s4: Vec<u8> = (0..300 * 2).flat_map(|_| 0.5f32.to_le_bytes()).collect();
    npy(&dir, &format!("{k1}__q4.npy"), Dtype::U8, &[300, 64], &p);
    npy(&dir, &format!("{k1}__s4.npy"), Dtype::F32, &[300, 2], &s4);
    shape_file(&dir, &k1, &[300, 128]);
    // Norm: f16 passthrough without a shape file.
    let k2 = safe_key(names[2]);
    let pt: Vec<u8> = (0..128)
        .flat_map(|i| half::f16::from_f32(i as f32 * 0.25).to_le_bytes())
        .collect();
    npy(&dir, &format!("{k2}__pt.npy"), Dtype::F16, &[128], &pt);

    let d = NpyDir::open(&dir).unwrap();
    assert!(!d.checksummed());
    assert!(d.verify_all().is_empty(), "{:?}", d.verify_all());
    assert_eq!(
        d.model()
            .tensors
            .iter()
            .map(|t| t.name.as_str())
            .collect::<Vec<_>>(),
        names
    );
    assert_eq!(d.tensor_summary(0).codec, "int8+zstd");
    assert_eq!(d.tensor_summary(1).codec, "int4(g=64)");
    let e = read_all(&d, 0).unwrap();
    assert_eq!(e[129], 2.0 * 0.02);
    let qp = read_all(&d, 1).unwrap();
    // 0x9E: column 0 = 0xE − 7 = 7, column 1 = 0x9 − 7 = 2; 0x77 → 0.
    assert_eq!(&qp[..4], &[3.5, 1.0, 0.0, 0.0]);
    assert_eq!(qp[128], 3.5);
    let n = read_all(&d, 2).unwrap();
    assert_eq!(n[5], 1.25);

    // The manifest the other way round (safe_key → name, as seed 002's prose says).
    let inv: serde_json::Map<String, Value> = names
        .iter()
        .map(|n| (safe_key(n), Value::String(n.to_string())))
        .collect();
    std::fs::write(dir.join(MANIFEST), serde_json::to_vec(&inv).unwrap()).unwrap();
    let d2 = NpyDir::open(&dir).unwrap();
    assert_eq!(d2.model().tensors, d.model().tensors);

    // Shapes that do not agree are errors naming the file.
    shape_file(&dir, &k1, &[300, 127]);
    let e = NpyDir::open(&dir).err().expect("opened").to_string();
    assert!(
        e.contains(&format!("{k1}__q4.npy")) && e.contains("does not hold"),
        "{e}"
    );
    shape_file(&dir, &k1, &[300, 128]);
    npy(
        &dir,
        &format!("{k1}__s4.npy"),
        Dtype::F32,
        &[300, 3],
        &vec![0; 300 * 12],
    );
    let e = NpyDir::open(&dir).err().expect("opened").to_string();
    assert!(e.contains("__s4.npy") && e.contains("scale shape"), "{e}");
    npy(
        &dir,
        &format!("{k1}__s4.npy"),
        Dtype::F16,
        &[300, 2],
        &vec![0; 300 * 4],
    );
    let e = NpyDir::open(&dir).err().expect("opened").to_string();
    assert!(e.contains("dtype <f2 is not allowed"), "{e}");
    npy(&dir, &format!("{k1}__s4.npy"), Dtype::F32, &[300, 2], &s4);
    // A whole-file stream whose frame does not record its size is refused at open: its
    // first read would otherwise size a buffer by the npy header's claim alone.
    let zst = dir.join(TENSOR_DIR).join(format!("{k0}__q.npy.zst"));
    let sized = std::fs::read(&zst).unwrap();
    let mut enc = zstd::stream::Encoder::new(Vec::new(), 3).unwrap();
    enc.include_contentsize(false).unwrap();
    std::io::Write::write_all(&mut enc, &plain).unwrap();
    std::fs::write(&zst, enc.finish().unwrap()).unwrap();
    let e = NpyDir::open(&dir).err().expect("opened").to_string();
    assert!(
        e.contains("__q.npy.zst") && e.contains("does not record its decompressed size"),
        "{e}"
    );
    std::fs::write(&zst, sized).unwrap();
    NpyDir::open(&dir).unwrap();
    // Without config.json the model cannot be described.
    std::fs::remove_file(dir.join("config.json")).unwrap();
    let e = NpyDir::open(&dir).err().expect("opened").to_string();
    assert!(e.contains("config.json is missing"), "{e}");
}

/// A cawsfs.json whose shape and rows_per_block claim 2^36 row blocks is refused by the
/// count of block checksums it lists, before anything is sized by the claim (it used to
/// build a 512 GiB table of frame lengths first).
#[test]
fn absurd_block_count_is_refused_before_allocating() {
    let src = source();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("z");
    write(&src, &dir, 8, true);
    let name = "model.layers.0.mlp.down_proj.weight";
    let key = safe_key(name);
    let huge = [1u64 << 36, 1];
    shape_file(&dir, &key, &huge);
    let shape_name = format!("{key}__shape.npy");
    let shape_sum = hex(xxhash_rust::xxh3::xxh3_64(
        &std::fs::read(dir.join(TENSOR_DIR).join(&shape_name)).unwrap(),
    ));
    edit_sidecar(&dir, |v| {
        for t in v["model"]["tensors"].as_array_mut().unwrap() {
            if t["name"] == name {
                t["shape"] = serde_json::json!(huge);
            }
        }
        for t in v["tensors"].as_array_mut().unwrap() {
            if t["name"] == name {
                t["rows_per_block"] = 1.into();
                t["files"]["shape"] = serde_json::json!({"file": shape_name, "xxh3": shape_sum});
            }
        }
    });
    let err = NpyDir::open(&dir).err().expect("must not open").to_string();
    assert!(
        err.contains("block checksums for 68719476736 blocks"),
        "{err}"
    );
}

/// A tensor index past the model is an out-of-range read, not a panic (it used to
/// index past the tensor table).
#[test]
fn read_of_a_missing_tensor_is_out_of_range() {
    let src = source();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("d");
    write(&src, &dir, 8, false);
    let d = NpyDir::open(&dir).unwrap();
    let err = d.read_rows(4, 0, 1, &mut [0f32; 128]).unwrap_err();
    assert!(matches!(err, ReadError::OutOfRange { .. }), "{err}");
    // A buffer of the wrong size is the caller's bug, as for the other kinds.
    let err = d.read_rows(0, 0, 1, &mut [0f32; 127]).unwrap_err();
    assert!(matches!(err, ReadError::Io(_)), "{err}");
    assert!(d.read_rows(0, 0, 1, &mut [0f32; 128]).is_ok());
}

/// Rewrites the body of `dir`'s cawsfs.json with `f` and seals it again, as a tool that
/// knows the format would (so the edit reaches the checks behind the checksum).
fn edit_sidecar(dir: &Path, f: impl FnOnce(&mut Value)) {
    let side = dir.join(SIDECAR);
    let outer: Value = serde_json::from_slice(&std::fs::read(&side).unwrap()).unwrap();
    let mut body = outer["body"].clone();
    f(&mut body);
    std::fs::write(&side, seal_sidecar(&body).unwrap()).unwrap();
}

/// Every byte of cawsfs.json is covered: flipping any one of them either makes the
/// directory refuse to open (naming cawsfs.json) or changes nothing that is served.
/// (It once changed a token-embedding row, and `n_kv_heads` re-permuted attn_k.)
#[test]
fn every_sidecar_byte_flip_is_refused_or_harmless() {
    let src = source();
    let tmp = tempfile::tempdir().unwrap();
    let base = tmp.path().join("b");
    write(&src, &base, 8, false);
    let want = read_all(&NpyDir::open(&base).unwrap(), 1).unwrap();
    let side = base.join(SIDECAR);
    let orig = std::fs::read(&side).unwrap();
    let (mut refused, mut harmless) = (0, 0);
    for pos in 0..orig.len() {
        for bit in [0x01u8, 0x20] {
            let mut b = orig.clone();
            b[pos] ^= bit;
            std::fs::write(&side, &b).unwrap();
            match NpyDir::open(&base) {
                Err(e) => {
                    let e = e.to_string();
                    assert!(e.contains(SIDECAR), "flip at {pos}: {e}");
                    assert_eq!(e.lines().count(), 1, "{e}");
                    refused += 1;
                }
                Ok(d) => {
                    let got = read_all(&d, 1).unwrap();
                    assert!(got == want, "flip {bit:#x} at {pos} changed served values");
                    assert!(d.verify_all().is_empty());
                    harmless += 1;
                }
            }
        }
    }
    assert!(
        refused > 2 * orig.len() - 8,
        "{refused} refused, {harmless} harmless"
    );
}

/// Edits that keep the checksum valid still meet the structural checks; a version 1
/// file (no checksum of its own) is refused with a line saying what to do.
#[test]
fn sidecar_versions_and_sealed_edits() {
    let src = source();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("v");
    write(&src, &dir, 8, false);
    let side = dir.join(SIDECAR);
    let outer: Value = serde_json::from_slice(&std::fs::read(&side).unwrap()).unwrap();
    assert_eq!(outer["version"], SIDECAR_VERSION);
    let mut v1 = outer["body"].clone();
    v1["format"] = SIDECAR_FORMAT.into();
    v1["version"] = 1.into();
    std::fs::write(&side, serde_json::to_vec(&v1).unwrap()).unwrap();
    let e = NpyDir::open(&dir).err().expect("v1 opened").to_string();
    assert!(
        e.contains("version 1") && e.contains("convert the model again"),
        "{e}"
    );
    std::fs::write(&side, seal_sidecar(&outer["body"]).unwrap()).unwrap();
    NpyDir::open(&dir).unwrap();
    edit_sidecar(&dir, |v| v["tensors"][0]["rows_per_block"] = 0.into());
    let e = NpyDir::open(&dir).err().expect("opened").to_string();
    assert!(e.contains("rows_per_block is 0"), "{e}");
}
