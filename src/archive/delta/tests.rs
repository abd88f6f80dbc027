//! Delta kind: decomposition accuracy, rank choice, clustering, the file's reader
//! against corrupt, truncated and hostile input (including a few hundred random
//! corruptions that must never panic).
#![allow(clippy::needless_range_loop)]

use std::collections::BTreeMap;
use std::path::Path;

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use xxhash_rust::xxh3::xxh3_64;

use super::format::*;
use super::*;
use crate::archive::container::{align_up, decompress};
use crate::archive::Compression;
use crate::archive::Store;
use crate::codec::delta::{self as decompose, RankChoice};
use crate::convert::delta::{convert, DeltaOptions, DeltaReport};
use crate::model::{ArchConfig, ModelDesc, ReadError, RowSource};
use crate::test_support::{self, f32_tensor, read_all, tiny_arch, MemSource};

const ROWS: usize = 48;
const COLS: usize = 1024; // 32 rows per block: blocks of 32 and 16 rows

fn randn(rng: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| (rng.random::<f32>() - 0.5 + rng.random::<f32>() - 0.5) * scale)
        .collect()
}

/// m×k · k×n, row-major.
fn mul(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    let mut c = vec![0f32; m * n];
    for i in 0..m {
        for p in 0..k {
            let x = a[i * k + p];
            for j in 0..n {
                c[i * n + j] += x * b[p * n + j];
            }
        }
    }
    c
}

/// A model whose q_proj of layer l is `base(group(l)) + A·C_l` (rank-k deltas sharing
/// their left factor, so W_l − mean is rank ≤ k too); an embedding and norms around.
fn synthetic(layers: usize, k: usize, groups: usize, seed: u64) -> MemSource {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let bases: Vec<Vec<f32>> = (0..groups)
        .map(|_| randn(&mut rng, ROWS * COLS, 0.1))
        .collect();
    let a = randn(&mut rng, ROWS * k, 0.2);
    let mut tensors = vec![f32_tensor("model.embed_tokens.weight", &[10, 16])];
    let mut data = vec![randn(&mut rng, 160, 1.0)];
    for l in 0..layers {
        tensors.push(f32_tensor(
            &format!("model.layers.{l}.input_layernorm.weight"),
            &[16],
        ));
        data.push(randn(&mut rng, 16, 1.0));
        tensors.push(f32_tensor(
            &format!("model.layers.{l}.self_attn.q_proj.weight"),
            &[ROWS as u64, COLS as u64],
        ));
        let c = randn(&mut rng, k * COLS, 0.1);
        let d = mul(&a, &c, ROWS, k, COLS);
        let g = l * groups / layers;
        data.push(bases[g].iter().zip(&d).map(|(b, x)| b + x).collect());
    }
    tensors.push(f32_tensor("model.norm.weight", &[16]));
    data.push(randn(&mut rng, 16, 1.0));
    let arch = ArchConfig {
        n_layers: layers as u32,
        hidden_size: 16,
        intermediate_size: 32,
        head_dim: 8,
        tie_word_embeddings: true,
        ..tiny_arch()
    };
    let desc = ModelDesc {
        hf_files: BTreeMap::from([("config.json".to_string(), b"{}".to_vec())]),
        ..test_support::model(arch, tensors)
    };
    MemSource { desc, data }
}

fn opts(rank: RankChoice) -> DeltaOptions {
    DeltaOptions {
        rank,
        ..Default::default()
    }
}

fn write(
    src: &MemSource,
    dir: &Path,
    name: &str,
    o: &DeltaOptions,
) -> (std::path::PathBuf, DeltaReport) {
    let p = dir.join(name);
    let r = convert(src, &p, o, &|_, _, _| {}).unwrap();
    (p, r)
}

fn rel_err(w: &[f32], r: &[f32]) -> f64 {
    let d: f64 = w.iter().zip(r).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
    let n: f64 = w.iter().map(|a| (*a as f64).powi(2)).sum();
    (d / n).sqrt()
}

#[test]
fn rank_k_deltas_reconstruct_to_f16_precision() {
    let k = 5;
    let src = synthetic(4, k, 1, 1);
    let dir = tempfile::tempdir().unwrap();
    let (p, rep) = write(&src, dir.path(), "a.cawsd", &opts(RankChoice::Fixed(k)));
    let a = DeltaArchive::open(&p).unwrap();
    assert!(a.verify_all().is_empty());
    assert_eq!(rep.matrices.len(), 4);
    for m in &rep.matrices {
        assert_eq!(m.rank, k);
        // The base (f16) and U, Vᵀ (f16) are the only errors left.
        assert!(m.rel_err < 2e-3, "{}: {}", m.name, m.rel_err);
        assert!(m.base_rel_err > 0.1, "{}: the deltas are not small", m.name);
        assert!(
            m.tail_ranks["0.05"] <= k,
            "tail rank of a rank-{k} residual"
        );
    }
    for (i, t) in src.desc.tensors.iter().enumerate() {
        let got = read_all(&a, i).unwrap();
        if t.shape.len() == 1 || t.name.contains("embed") {
            assert!(got == src.data[i], "passthrough is exact: {}", t.name);
        } else {
            let e = rel_err(&src.data[i], &got);
            let m = rep.matrices.iter().find(|m| m.name == t.name).unwrap();
            // What the reader reconstructs is what the report measured.
            assert!(
                (e - m.rel_err).abs() < 1e-5,
                "{}: read {e}, reported {}",
                t.name,
                m.rel_err
            );
            // Any sub-range of rows equals the same rows of a whole read.
            for (r0, r1) in [(0u64, 1u64), (31, 33), (40, 48), (5, 5), (0, 48)] {
                let mut part = vec![0f32; (r1 - r0) as usize * COLS];
                a.read_rows(i, r0, r1, &mut part).unwrap();
                assert!(
                    part == got[r0 as usize * COLS..r1 as usize * COLS],
                    "rows {r0}..{r1} differ"
                );
            }
        }
    }
    // One rank fewer loses a real component.
    let (_, rep1) = write(&src, dir.path(), "b.cawsd", &opts(RankChoice::Fixed(k - 1)));
    assert!(rep1.matrices.iter().all(|m| m.rel_err > 20.0 * 2e-3));
    // Rank 0 reads back the base itself.
    let (p0, rep0) = write(&src, dir.path(), "c.cawsd", &opts(RankChoice::Fixed(0)));
    let a0 = DeltaArchive::open(&p0).unwrap();
    for m in &rep0.matrices {
        assert_eq!(m.rank, 0);
        assert!((m.rel_err - m.base_rel_err).abs() < 1e-9);
    }
    let q0 = read_all(&a0, 2).unwrap();
    let q1 = read_all(&a0, 4).unwrap();
    assert!(q0 == q1, "rank 0: every layer is its base");
    // Sizes: rank-0 U blocks are empty; rank k costs (rows + cols)·k f16 per matrix.
    assert!(rep
        .matrices
        .iter()
        .all(|m| m.bytes <= ((ROWS + COLS) * k * 2) as u64 + 64));
}

#[test]
fn max_rel_err_picks_the_smallest_rank() {
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let (m, n) = (40, 64);
    let base = randn(&mut rng, m * n, 0.05);
    // Residual with geometrically decaying singular values.
    let mut w = base.clone();
    for i in 0..20 {
        let u = randn(&mut rng, m, 1.0);
        let v = randn(&mut rng, n, 1.0);
        let s = 0.7f32.powi(i);
        for r in 0..m {
            for c in 0..n {
                w[r * n + c] += s * u[r] * v[c];
            }
        }
    }
    for e in [0.3, 0.1, 0.02] {
        let d = decompose::decompose(&w, &base, m, n, 16, RankChoice::MaxRelErr(e)).unwrap();
        assert!(d.rel_err <= e && !d.unreachable, "{e}: {}", d.rel_err);
        assert!(d.rank > 0);
        let below =
            decompose::decompose(&w, &base, m, n, 16, RankChoice::Fixed(d.rank - 1)).unwrap();
        assert!(below.rel_err > e, "rank {} already meets {e}", d.rank - 1);
        assert_eq!(d.u_blocks.len(), 3);
        assert_eq!(d.vt.len(), d.rank * n * 2);
    }
    // Zero error cannot be met with f16 factors: full rank, flagged.
    let d = decompose::decompose(&w, &base, m, n, 16, RankChoice::MaxRelErr(0.0)).unwrap();
    assert!(d.unreachable && d.rank == m);
    // A bound the base alone meets: rank 0.
    let d = decompose::decompose(&w, &base, m, n, 16, RankChoice::MaxRelErr(10.0)).unwrap();
    assert_eq!(d.rank, 0);
}

#[test]
fn k_bases_separate_two_groups_of_layers() {
    let src = synthetic(6, 2, 2, 5);
    let ws: Vec<&[f32]> = (0..6).map(|l| src.data[2 + 2 * l].as_slice()).collect();
    let (assign, means) = decompose::cluster_layers(&ws, 2, 10);
    assert_eq!(assign, vec![0, 0, 0, 1, 1, 1]);
    assert_eq!(means.len(), 2);
    let (assign1, _) = decompose::cluster_layers(&ws, 1, 10);
    assert_eq!(assign1, vec![0; 6]);
    // More clusters than layers: each layer its own.
    let (assign9, means9) = decompose::cluster_layers(&ws[..2], 9, 10);
    assert_eq!((assign9, means9.len()), (vec![0, 1], 2));

    let dir = tempfile::tempdir().unwrap();
    let two = DeltaOptions {
        bases: 2,
        ..opts(RankChoice::Fixed(2))
    };
    let (p, rep) = write(&src, dir.path(), "k2.cawsd", &two);
    assert_eq!(rep.bases.len(), 2);
    assert_eq!(rep.bases[0].layers, vec![0, 1, 2]);
    assert_eq!(rep.bases[1].layers, vec![3, 4, 5]);
    assert!(rep.matrices.iter().all(|m| m.rel_err < 2e-3));
    let (_, rep1) = write(&src, dir.path(), "k1.cawsd", &opts(RankChoice::Fixed(2)));
    assert!(
        rep1.matrices.iter().all(|m| m.rel_err > 0.1),
        "one base cannot fit both groups at rank 2"
    );
    assert!(rep.matrices.iter().all(|m| m.cos_base > 0.9));
    let a = DeltaArchive::open(&p).unwrap();
    assert_eq!(a.n_bases(), 2);
    assert!(a.tensor_summary(2).codec.contains("q_proj#0"));
    assert!(a.tensor_summary(2 + 2 * 4).codec.contains("q_proj#1"));
}

#[test]
fn int8_bases_and_determinism() {
    let src = synthetic(3, 3, 1, 7);
    let dir = tempfile::tempdir().unwrap();
    let o = DeltaOptions {
        base_dtype: BaseDtype::Int8,
        ..opts(RankChoice::Fixed(3))
    };
    let (p, rep) = write(&src, dir.path(), "i8.cawsd", &o);
    let a = DeltaArchive::open(&p).unwrap();
    for m in &rep.matrices {
        let i = src.desc.tensor_index(&m.name).unwrap();
        let e = rel_err(&src.data[i], &read_all(&a, i).unwrap());
        assert!(
            (e - m.rel_err).abs() < 1e-5 && e < 0.02,
            "{}: {e} vs {}",
            m.name,
            m.rel_err
        );
    }
    // Same input and options: same bytes, whatever the thread count.
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    let q = dir.path().join("i8-again.cawsd");
    pool.install(|| convert(&src, &q, &o, &|_, _, _| {}))
        .unwrap();
    assert_eq!(std::fs::read(&p).unwrap(), std::fs::read(&q).unwrap());
    // Through store::open, by magic.
    let s = crate::archive::open(&p).unwrap();
    assert_eq!(s.kind(), crate::archive::Kind::Delta);
}

/// A small valid archive's bytes.
fn small_archive(dir: &Path) -> (std::path::PathBuf, Vec<u8>) {
    let src = synthetic(3, 2, 1, 11);
    let o = DeltaOptions {
        compression: Compression::Zstd(3),
        ..opts(RankChoice::Fixed(2))
    };
    let (p, _) = write(&src, dir, "small.cawsd", &o);
    let bytes = std::fs::read(&p).unwrap();
    (p, bytes)
}

fn open_bytes(dir: &Path, name: &str, bytes: &[u8]) -> Result<DeltaArchive, String> {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    DeltaArchive::open(&p).map_err(|e| e.to_string())
}

fn rehash_header(b: &mut [u8]) {
    let n = le_u32(&b[24..28]) as usize;
    let end = HEADER_FIXED + TOC_RECORD * n;
    if end + 8 > b.len() {
        return; // a corrupted section count: nothing to fix up
    }
    let h = xxh3_64(&b[..end]);
    b[end..end + 8].copy_from_slice(&h.to_le_bytes());
}

/// Replace META with `f(meta JSON)`, appended at the end, TOC and header updated.
fn with_meta(bytes: &[u8], f: impl FnOnce(&mut serde_json::Value)) -> Vec<u8> {
    let mut b = bytes.to_vec();
    let n = le_u32(&b[24..28]) as usize;
    let k = (0..n)
        .find(|&k| {
            TocRecord::parse(&b[HEADER_FIXED + 40 * k..HEADER_FIXED + 40 * (k + 1)]).ty == SEC_META
        })
        .unwrap();
    let at = HEADER_FIXED + 40 * k;
    let rec = TocRecord::parse(&b[at..at + 40]);
    let raw = decompress(
        &b[rec.offset as usize..(rec.offset + rec.size) as usize],
        COMP_ZSTD_CODE,
        rec.usize as usize,
    )
    .unwrap()
    .into_owned();
    let mut v: serde_json::Value = serde_json::from_slice(&raw).unwrap();
    f(&mut v);
    let json = serde_json::to_vec(&v).unwrap();
    let off = b.len() as u64;
    b.extend_from_slice(&json);
    b.resize(align_up(b.len() as u64) as usize, 0);
    let new = TocRecord {
        ty: SEC_META,
        flags: 0,
        offset: off,
        size: json.len() as u64,
        usize: json.len() as u64,
        xxh3: xxh3_64(&json),
    };
    let mut rb = Vec::new();
    new.write(&mut rb);
    b[at..at + 40].copy_from_slice(&rb);
    rehash_header(&mut b);
    b
}

const COMP_ZSTD_CODE: u8 = 1;

#[test]
fn bad_files_give_one_line_errors() {
    let dir = tempfile::tempdir().unwrap();
    let (_, good) = small_archive(dir.path());
    assert!(open_bytes(dir.path(), "ok", &good).is_ok());
    let mut cases: Vec<(&str, Vec<u8>, &str)> = Vec::new();
    let mut magic = good.clone();
    magic[0] = b'X';
    cases.push(("magic", magic, "bad magic"));
    let mut version = good.clone();
    version[8..12].copy_from_slice(&99u32.to_le_bytes());
    cases.push(("version", version, "unsupported delta archive version 99"));
    cases.push(("truncated", good[..good.len() / 2].to_vec(), "truncated"));
    cases.push(("tiny", good[..20].to_vec(), "truncated"));
    let mut hdr = good.clone();
    hdr[40] ^= 1;
    cases.push(("header", hdr, "header failed its XXH3-64 check"));
    let mut count = good.clone();
    count[24..28].copy_from_slice(&5000u32.to_le_bytes());
    cases.push(("count", count, "section count 5000"));
    let mut size = good.clone();
    size[HEADER_FIXED + 16..HEADER_FIXED + 24].copy_from_slice(&(u64::MAX - 100).to_le_bytes());
    rehash_header(&mut size);
    cases.push(("size", size, "overflows"));
    let mut dtype = good.clone();
    dtype[20] = 9;
    cases.push(("dtype", dtype, "base dtype code 9"));
    cases.push((
        "shape",
        with_meta(&good, |v| {
            v["model"]["tensors"][2]["shape"] = serde_json::json!([1u64 << 40, 1u64 << 40])
        }),
        "absurd shape",
    ));
    cases.push((
        "rank",
        with_meta(&good, |v| {
            v["tensors"][2]["rank"] = serde_json::json!(100000)
        }),
        "rank 100000 exceeds",
    ));
    cases.push((
        "twice",
        with_meta(&good, |v| {
            v["tensors"][4]["vt_blob"] = v["tensors"][2]["vt_blob"].clone()
        }),
        "referenced twice",
    ));
    cases.push((
        "blocks",
        with_meta(&good, |v| {
            v["bases"][0]["rows_per_block"] = serde_json::json!(0)
        }),
        "cannot cover",
    ));
    cases.push((
        "base",
        with_meta(&good, |v| v["tensors"][2]["base"] = serde_json::json!(7)),
        "base 7 does not exist",
    ));
    for (what, bytes, needle) in cases {
        let e = open_bytes(dir.path(), what, &bytes)
            .err()
            .unwrap_or_else(|| panic!("{what} opened"));
        assert!(e.contains(needle), "{what}: {e}");
        assert!(
            e.contains(what) && !e.contains('\n'),
            "{what}: names the file, one line: {e}"
        );
    }
}

#[test]
fn corrupt_blobs_fail_their_reads_only() {
    let dir = tempfile::tempdir().unwrap();
    let (p, good) = small_archive(dir.path());
    let a = DeltaArchive::open(&p).unwrap();
    let q1 = 4; // model.layers.1.self_attn.q_proj.weight
    assert_eq!(
        a.model().tensors[q1].name,
        "model.layers.1.self_attn.q_proj.weight"
    );
    let (off, len) = a.block_locations(q1)[1];
    let mut bad = good.clone();
    bad[(off + len / 2) as usize] ^= 0x10;
    let b = open_bytes(dir.path(), "ublock", &bad).unwrap();
    let fails = b.verify_all();
    assert!(
        fails[0].contains("block 1 of tensor model.layers.1.self_attn.q_proj.weight"),
        "{fails:?}"
    );
    let mut out = vec![0f32; 16 * COLS];
    match b.read_rows(q1, 32, 48, &mut out) {
        Err(ReadError::Checksum { tensor, block, .. }) => {
            assert_eq!(
                (tensor.as_str(), block),
                ("model.layers.1.self_attn.q_proj.weight", 1)
            )
        }
        other => panic!("{other:?}"),
    }
    // The other block of the tensor and the other layers still read.
    let mut first = vec![0f32; 32 * COLS];
    b.read_rows(q1, 0, 32, &mut first).unwrap();
    assert!(read_all(&b, 2).is_ok() && read_all(&b, 6).is_ok());

    // A base block: every layer's read of those rows fails, naming the base.
    let (off, len) = a.base_block_locations(0)[0];
    let mut bad = good.clone();
    bad[(off + len / 3) as usize] ^= 0x01;
    let b = open_bytes(dir.path(), "baseblock", &bad).unwrap();
    for t in [2, 4, 6] {
        match read_all(&b, t) {
            Err(ReadError::Corrupt {
                reason, block: 0, ..
            }) => {
                assert!(
                    reason.contains("base q_proj#0 block 0") && reason.contains("XXH3-64"),
                    "{reason}"
                )
            }
            other => panic!("{other:?}"),
        }
        let mut tail = vec![0f32; 16 * COLS];
        b.read_rows(t, 32, 48, &mut tail).unwrap();
    }
    assert!(b.verify_all()[0].contains("base q_proj#0 block 0"));

    // The Vᵀ blob.
    let (off, len) = a.vt_location(q1).unwrap();
    let mut bad = good.clone();
    bad[(off + len - 1) as usize] ^= 0x80;
    let b = open_bytes(dir.path(), "vt", &bad).unwrap();
    assert!(
        matches!(read_all(&b, q1), Err(ReadError::Corrupt { reason, .. }) if reason.contains("Vt blob"))
    );
    assert!(b.verify_all()[0].contains("Vt blob"));
}

#[test]
fn random_corruption_never_panics() {
    let dir = tempfile::tempdir().unwrap();
    let (_, good) = small_archive(dir.path());
    let mut rng = ChaCha8Rng::seed_from_u64(99);
    let p = dir.path().join("fuzz.cawsd");
    let header_end = HEADER_FIXED + TOC_RECORD * le_u32(&good[24..28]) as usize;
    let mut opened = 0;
    for round in 0..300 {
        let mut b = good.clone();
        match round % 3 {
            // Header and TOC bytes, checksum fixed up so parsing goes on.
            0 => {
                for _ in 0..rng.random_range(1..4) {
                    let i = rng.random_range(0..header_end);
                    b[i] ^= 1 << rng.random_range(0..8);
                }
                rehash_header(&mut b);
            }
            // Anywhere in the file.
            1 => {
                for _ in 0..rng.random_range(1..8) {
                    let i = rng.random_range(0..b.len());
                    b[i] = rng.random();
                }
            }
            // Truncated.
            _ => b.truncate(rng.random_range(0..b.len())),
        }
        std::fs::write(&p, &b).unwrap();
        let r = std::panic::catch_unwind(|| {
            if let Ok(a) = DeltaArchive::open(&p) {
                let _ = a.verify_all();
                for i in 0..a.model().tensors.len() {
                    let _ = read_all(&a, i);
                }
                true
            } else {
                false
            }
        });
        match r {
            Ok(true) => opened += 1,
            Ok(false) => {}
            Err(_) => panic!("round {round} panicked"),
        }
    }
    assert!(opened > 0, "some corruptions (in blobs) still open");
}
