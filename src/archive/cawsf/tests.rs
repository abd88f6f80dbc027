//! Container tests that need no codec: payloads are arbitrary bytes, read back raw.
#![allow(clippy::needless_range_loop, clippy::type_complexity)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use xxhash_rust::xxh3::xxh3_64;

use super::format::*;
use super::*;
use crate::archive::container::*;
use crate::archive::{encode_routing, Shard, ShardKind};
use crate::codec::EncodedTensor;
use crate::gguf::GgufValue;
use crate::model::SourceType;
use crate::test_support::{self, f32_tensor, tiny_arch};

fn model() -> ModelDesc {
    let mut hf_files = BTreeMap::new();
    hf_files.insert("config.json".to_string(), b"{\"a\":1}".to_vec());
    hf_files.insert("blob.bin".to_string(), vec![0xff, 0x00, 0x80]);
    ModelDesc {
        hf_files,
        gguf_meta: vec![("general.name".into(), GgufValue::String("tiny".into()))],
        ..test_support::model(
            tiny_arch(),
            vec![
                f32_tensor("model.embed_tokens.weight", &[10, 4]),
                f32_tensor("model.norm.weight", &[4]),
                f32_tensor("model.layers.0.mlp.up_proj.weight", &[8, 4]),
            ],
        )
    }
}

const RPB: [u64; 3] = [3, 1, 8];

/// f32 row-major data of tensor `i` (compressible: few distinct values).
fn tensor_values(m: &ModelDesc, i: usize) -> Vec<f32> {
    let d = &m.tensors[i];
    (0..d.numel())
        .map(|k| ((k * 7 + i as u64) % 5) as f32 * 0.5)
        .collect()
}

fn encoded(m: &ModelDesc, i: usize) -> EncodedTensor {
    let d = &m.tensors[i];
    let vals = tensor_values(m, i);
    let cols = d.cols() as usize;
    let rpb = RPB[i] as usize;
    let blocks = vals
        .chunks(rpb * cols)
        .map(|c| bytemuck::cast_slice::<f32, u8>(c).to_vec())
        .collect();
    EncodedTensor {
        codec: TensorCodec::Passthrough {
            format: SourceType::F32,
        },
        // A non-empty global for tensor 2, to exercise CODEBOOKS.
        global: if i == 2 {
            (0..300u32).flat_map(|x| (x % 7).to_le_bytes()).collect()
        } else {
            Vec::new()
        },
        blocks,
        rel_err: 0.0,
    }
}

fn routing() -> Routing {
    let shard = |tensor, kind, key: Vec<(u32, f32)>| Shard {
        tensor,
        kind,
        order: tensor + 1,
        row0: 0,
        row1: 2,
        cost: 16,
        key,
    };
    Routing {
        dim: 3,
        shards: vec![
            shard(0, ShardKind::Embedding, vec![(0, 1.0)]),
            shard(1, ShardKind::Other, vec![]),
            shard(2, ShardKind::Expert, vec![(1, 0.6), (2, -0.8)]),
        ],
    }
}

fn write(path: &Path, c: Compression) -> u64 {
    let m = model();
    let mut w = CawsfWriter::create(path, c).unwrap();
    for i in 0..m.tensors.len() {
        w.add_tensor(i, RPB[i], &encoded(&m, i)).unwrap();
    }
    w.finish(
        &m,
        serde_json::json!({"opts": {"b": 1, "a": 2}}),
        &encode_routing(&routing()),
    )
    .unwrap()
}

fn tmp() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("model.cawsf");
    (dir, p)
}

#[test]
fn round_trip_all_compressions() {
    for c in [Compression::None, Compression::Zstd(3), Compression::Lz4] {
        let (dir, p) = tmp();
        let size = write(&p, c);
        assert_eq!(size, std::fs::metadata(&p).unwrap().len());
        assert_eq!(size % 4096, 0);
        // No spool or temp file left behind.
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(names.len(), 1, "{c:?}");

        let a = CawsfArchive::open(&p).unwrap();
        let m = model();
        assert_eq!(a.model(), &m);
        assert_eq!(a.extra(), &serde_json::json!({"opts": {"b": 1, "a": 2}}));
        assert_eq!(a.routing(), &encode_routing(&routing())[..]);
        assert_eq!(a.routes().unwrap(), routing());
        let secs = a.sections();
        assert_eq!(secs.len(), 5);
        for s in &secs {
            assert_eq!(s.offset % 4096, 0, "{s:?}");
        }
        for i in 0..m.tensors.len() {
            let e = encoded(&m, i);
            let info = a.tensor_info(i);
            assert_eq!(info.n_blocks, e.blocks.len());
            assert_eq!(info.rows_per_block, RPB[i]);
            assert_eq!(info.codec, e.codec);
            assert!(info.stored_bytes > 0);
            for (b, blk) in e.blocks.iter().enumerate() {
                assert_eq!(&a.block_payload(i, b).unwrap(), blk, "{c:?} t{i} b{b}");
                let (off, len) = a.block_location(i, b);
                assert_eq!(off % 16, 0, "payloads are 16-byte aligned");
                if c == Compression::None {
                    assert_eq!(len as usize, blk.len());
                }
            }
            assert!(a.block_payload(i, e.blocks.len()).is_err());
        }
        assert!(a.verify_all().is_empty(), "{:?}", a.verify_all());
        a.verify().unwrap();
    }
}

#[test]
fn reads_cut_mid_block_read_each_block_once() {
    let (_dir, p) = tmp();
    write(&p, Compression::Zstd(3));
    let a = CawsfArchive::open(&p).unwrap();
    let m = model();
    // Tensor 0: 10 rows of 4 in 3-row blocks, read 2 rows at a time, so blocks 0..3 are
    // each cut by a read boundary (as chunk boundaries cut them in a sequential pass).
    let want = tensor_values(&m, 0);
    let mut got = Vec::new();
    for r in (0..10).step_by(2) {
        let mut out = vec![0f32; 8];
        a.read_rows(0, r, r + 2, &mut out).unwrap();
        got.extend(out);
    }
    assert_eq!(got, want);
    assert_eq!(a.read_counters().blocks, a.tensor_info(0).n_blocks as u64);
    // Each block cut by a read was dropped once its last row was taken.
    assert_eq!(a.memo.bytes(), 0);
    // A block read in part stays until the rest is read, and then goes.
    let mut out = vec![0f32; 4];
    a.read_rows(0, 4, 5, &mut out).unwrap();
    assert_eq!(out, want[16..20]);
    assert!(a.memo.bytes() > 0);
    a.read_rows(0, 3, 4, &mut out).unwrap();
    a.read_rows(0, 5, 6, &mut out).unwrap();
    assert_eq!(out, want[20..24]);
    assert_eq!(a.memo.bytes(), 0);
    assert_eq!(
        a.read_counters().blocks,
        a.tensor_info(0).n_blocks as u64 + 1
    );
}

#[test]
fn compression_shrinks_blocks() {
    let (_d1, p1) = tmp();
    let (_d2, p2) = tmp();
    write(&p1, Compression::None);
    write(&p2, Compression::Zstd(3));
    let a1 = CawsfArchive::open(&p1).unwrap();
    let a2 = CawsfArchive::open(&p2).unwrap();
    assert!(a2.tensor_info(0).stored_bytes < a1.tensor_info(0).stored_bytes);
}

#[test]
fn deterministic_bytes() {
    for c in [Compression::Zstd(3), Compression::Lz4] {
        let (_d1, p1) = tmp();
        let (_d2, p2) = tmp();
        write(&p1, c);
        write(&p2, c);
        assert_eq!(std::fs::read(&p1).unwrap(), std::fs::read(&p2).unwrap());
    }
}

#[test]
fn flipped_byte_in_any_block_is_caught() {
    let (_d, p) = tmp();
    write(&p, Compression::Zstd(3));
    let clean = std::fs::read(&p).unwrap();
    let a = CawsfArchive::open(&p).unwrap();
    let m = model();
    let mut locs = Vec::new();
    for i in 0..m.tensors.len() {
        for b in 0..a.tensor_info(i).n_blocks {
            locs.push((i, b, a.block_location(i, b)));
        }
    }
    drop(a);
    for (i, b, (off, len)) in locs {
        for at in [off, off + len - 1] {
            let mut bytes = clean.clone();
            bytes[at as usize] ^= 0x40;
            std::fs::write(&p, &bytes).unwrap();
            // The index and META are intact, so open succeeds; the block fails on read.
            let a = CawsfArchive::open(&p).unwrap();
            match a.block_payload(i, b) {
                Err(ReadError::Checksum { tensor, block, .. }) => {
                    assert_eq!(tensor, m.tensors[i].name);
                    assert_eq!(block, b);
                }
                other => panic!("t{i} b{b}: expected checksum error, got {other:?}"),
            }
            // Neighbouring blocks still read.
            if b > 0 {
                a.block_payload(i, b - 1).unwrap();
            }
            let fails = a.verify_all();
            let want = format!("block {b} of tensor {}", m.tensors[i].name);
            assert!(fails.iter().any(|f| f.contains(&want)), "{fails:?}");
            assert!(
                fails.iter().any(|f| f.contains("section SHARD_BANK")),
                "{fails:?}"
            );
            assert_eq!(fails.len(), 2, "{fails:?}");
            let err = a.verify().unwrap_err().to_string();
            assert!(err.contains(&want), "{err}");
            // read_rows refuses before any decoding.
            let cols = m.tensors[i].cols();
            let r0 = b as u64 * RPB[i];
            let mut out = vec![0f32; cols as usize];
            assert!(matches!(
                a.read_rows(i, r0, r0 + 1, &mut out),
                Err(ReadError::Checksum { .. })
            ));
        }
    }
}

#[test]
fn corrupt_global_blob_is_caught() {
    let (_d, p) = tmp();
    write(&p, Compression::None);
    let a = CawsfArchive::open(&p).unwrap();
    let cb = a
        .sections()
        .into_iter()
        .find(|s| s.kind == "CODEBOOKS")
        .unwrap();
    assert!(cb.size > 0);
    drop(a);
    let mut bytes = std::fs::read(&p).unwrap();
    bytes[cb.offset as usize + 5] ^= 1;
    std::fs::write(&p, &bytes).unwrap();
    let a = CawsfArchive::open(&p).unwrap();
    let fails = a.verify_all();
    assert!(
        fails
            .iter()
            .any(|f| f.contains("model.layers.0.mlp.up_proj.weight global blob")),
        "{fails:?}"
    );
    let mut out = vec![0f32; 4];
    // Fails on the global's checksum before the codec is involved.
    match a.read_rows(2, 0, 1, &mut out) {
        Err(ReadError::Corrupt { tensor, reason, .. }) => {
            assert_eq!(tensor, "model.layers.0.mlp.up_proj.weight");
            assert!(reason.contains("XXH3"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn read_rows_rejects_bad_ranges() {
    let (_d, p) = tmp();
    write(&p, Compression::Lz4);
    let a = CawsfArchive::open(&p).unwrap();
    let mut out = vec![0f32; 4];
    assert!(matches!(
        a.read_rows(0, 10, 11, &mut out),
        Err(ReadError::OutOfRange { .. })
    ));
    assert!(matches!(
        a.read_rows(0, 3, 2, &mut out),
        Err(ReadError::OutOfRange { .. })
    ));
    assert!(matches!(
        a.read_rows(9, 0, 1, &mut out),
        Err(ReadError::OutOfRange { .. })
    ));
    assert!(a.read_rows(0, 0, 2, &mut out).is_err(), "wrong out length");
    a.read_rows(0, 4, 4, &mut []).unwrap();
    assert!(a.apply(0, &[1.0; 3]).is_err());
}

fn open_err(p: &Path) -> String {
    match CawsfArchive::open(p) {
        Ok(_) => panic!("open of a damaged archive succeeded"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn truncated_files_error_without_panic() {
    let (_d, p) = tmp();
    write(&p, Compression::Zstd(3));
    let clean = std::fs::read(&p).unwrap();
    let n = clean.len();
    // Only the trailing zero padding after the last section may be cut.
    let last_end = CawsfArchive::open(&p)
        .unwrap()
        .sections()
        .iter()
        .map(|s| s.offset + s.size)
        .max()
        .unwrap() as usize;
    for l in last_end..n {
        std::fs::write(&p, &clean[..l]).unwrap();
        CawsfArchive::open(&p).unwrap().verify().unwrap();
    }
    let mut lens: Vec<usize> = vec![0, 1, 7, 8, 12, 16, 17, 100, 215, 216, 223, 224, 4095, 4096];
    lens.extend((4097..last_end).step_by(97));
    lens.extend([n - 4096, last_end - 1]);
    for l in lens {
        std::fs::write(&p, &clean[..l]).unwrap();
        let e = open_err(&p);
        assert!(e.starts_with(&p.display().to_string()), "{e}");
        assert!(!e.contains('\n'), "{e}");
    }
    std::fs::write(&p, &clean[..n - 4096]).unwrap();
    assert!(open_err(&p).contains("truncated: TOC says section META ends at"));
}

/// Rewrite the header (recomputing its checksum) after `f` edits the TOC.
fn edit_toc(bytes: &mut [u8], f: impl Fn(&mut TocRecord)) {
    let n = le_u32(&bytes[12..16]) as usize;
    for i in 0..n {
        let at = HEADER_FIXED + i * TOC_RECORD;
        let mut r = TocRecord::parse(&bytes[at..at + TOC_RECORD]);
        f(&mut r);
        let mut v = Vec::new();
        r.write(&mut v);
        bytes[at..at + TOC_RECORD].copy_from_slice(&v);
    }
    let end = HEADER_FIXED + n * TOC_RECORD;
    let h = xxh3_64(&bytes[..end]);
    bytes[end..end + 8].copy_from_slice(&h.to_le_bytes());
}

#[test]
fn bad_magic_version_and_header() {
    let (_d, p) = tmp();
    write(&p, Compression::Zstd(3));
    let clean = std::fs::read(&p).unwrap();

    let mut b = clean.clone();
    b[0] = b'X';
    std::fs::write(&p, &b).unwrap();
    assert!(open_err(&p).contains("bad magic"));

    let mut b = clean.clone();
    b[8..12].copy_from_slice(&2u32.to_le_bytes());
    std::fs::write(&p, &b).unwrap();
    assert!(open_err(&p).contains("unsupported cawsf version 2"));

    let mut b = clean.clone();
    b[12..16].copy_from_slice(&1000u32.to_le_bytes());
    std::fs::write(&p, &b).unwrap();
    assert!(open_err(&p).contains("section count 1000"));

    // A flipped TOC byte fails the header checksum.
    let mut b = clean.clone();
    b[HEADER_FIXED + 9] ^= 1;
    std::fs::write(&p, &b).unwrap();
    assert!(open_err(&p).contains("header failed its XXH3-64 check"));
}

#[test]
fn absurd_toc_values_are_rejected() {
    let (_d, p) = tmp();
    write(&p, Compression::Zstd(3));
    let clean = std::fs::read(&p).unwrap();
    let cases: Vec<(Box<dyn Fn(&mut TocRecord)>, &str)> = vec![
        (
            Box::new(|r| {
                if r.ty == SEC_SHARD_BANK {
                    r.size = u64::MAX - 100
                }
            }),
            "overflows",
        ),
        (
            Box::new(|r| {
                if r.ty == SEC_SHARD_BANK {
                    r.size = 1 << 40;
                    r.usize = 1 << 40;
                }
            }),
            "truncated: TOC says section SHARD_BANK ends at",
        ),
        (
            Box::new(|r| {
                if r.ty == SEC_META {
                    r.usize = 1 << 50
                }
            }),
            "claims",
        ),
        (
            Box::new(|r| {
                if r.ty == SEC_META {
                    r.usize += 1
                }
            }),
            "META is corrupt",
        ),
        (
            Box::new(|r| {
                if r.ty == SEC_CODEBOOKS {
                    r.offset += 1
                }
            }),
            "4 KiB-aligned",
        ),
        (
            Box::new(|r| {
                if r.ty == SEC_CODEBOOKS {
                    r.flags = FLAG_ZSTD
                }
            }),
            "must not be compressed",
        ),
        (
            Box::new(|r| {
                if r.ty == SEC_META {
                    r.flags = 3
                }
            }),
            "invalid flags",
        ),
        (
            Box::new(|r| {
                if r.ty == SEC_ROUTING {
                    r.ty = SEC_META
                }
            }),
            "appears twice",
        ),
        (
            Box::new(|r| {
                if r.ty == SEC_BLOCK_INDEX {
                    r.ty = 77
                }
            }),
            "BLOCK_INDEX is missing",
        ),
        (
            Box::new(|r| {
                if r.ty == SEC_CODEBOOKS {
                    r.offset = 4096
                }
            }),
            "overlap",
        ),
        (
            Box::new(|r| {
                if r.ty == SEC_META {
                    r.xxh3 ^= 1
                }
            }),
            "section META failed its XXH3-64 check",
        ),
        (
            Box::new(|r| {
                if r.ty == SEC_SHARD_BANK {
                    r.xxh3 ^= 1
                }
            }),
            "checksum_index entry for SHARD_BANK disagrees",
        ),
    ];
    for (f, want) in cases {
        let mut b = clean.clone();
        edit_toc(&mut b, f);
        std::fs::write(&p, &b).unwrap();
        let e = open_err(&p);
        assert!(e.contains(want), "want {want:?}, got {e}");
    }
}

/// Rewrite META (as JSON) and BLOCK_INDEX (as raw bytes) uncompressed in place, keeping
/// every checksum consistent, so the reader's semantic checks are what is tested.
fn tamper(p: &Path, f: impl Fn(&mut serde_json::Value, &mut Vec<u8>)) -> String {
    let mut bytes = std::fs::read(p).unwrap();
    let n = le_u32(&bytes[12..16]) as usize;
    let recs: Vec<TocRecord> = (0..n)
        .map(|i| {
            let at = HEADER_FIXED + i * TOC_RECORD;
            TocRecord::parse(&bytes[at..at + TOC_RECORD])
        })
        .collect();
    let get = |ty: u32| *recs.iter().find(|r| r.ty == ty).unwrap();
    let (meta_r, idx_r) = (get(SEC_META), get(SEC_BLOCK_INDEX));
    let load = |b: &[u8], r: &TocRecord| {
        let s = &b[r.offset as usize..(r.offset + r.size) as usize];
        decompress(s, flags_to_comp(r.flags).unwrap(), r.usize as usize)
            .unwrap()
            .into_owned()
    };
    let mut meta: serde_json::Value = serde_json::from_slice(&load(&bytes, &meta_r)).unwrap();
    let mut idx = load(&bytes, &idx_r);
    f(&mut meta, &mut idx);
    assert!(idx.len() <= 4096, "index must fit its page");
    let idx_h = xxh3_64(&idx);
    meta["checksum_index"]["BLOCK_INDEX"] = serde_json::Value::String(hex64(idx_h));
    let json = serde_json::to_vec(&meta).unwrap();
    // META is the last section: rewrite the tail of the file.
    bytes.truncate(meta_r.offset as usize);
    bytes.extend_from_slice(&json);
    bytes.resize(align_up(bytes.len() as u64) as usize, 0);
    let at = idx_r.offset as usize;
    bytes[at..at + idx.len()].copy_from_slice(&idx);
    let meta_h = xxh3_64(&json);
    edit_toc(&mut bytes, |r| {
        if r.ty == SEC_META {
            *r = TocRecord {
                flags: 0,
                size: json.len() as u64,
                usize: json.len() as u64,
                xxh3: meta_h,
                ..*r
            };
        } else if r.ty == SEC_BLOCK_INDEX {
            *r = TocRecord {
                flags: 0,
                size: idx.len() as u64,
                usize: idx.len() as u64,
                xxh3: idx_h,
                ..*r
            };
        }
    });
    std::fs::write(p, &bytes).unwrap();
    match CawsfArchive::open(p) {
        Ok(_) => "ok".into(),
        Err(e) => e.to_string(),
    }
}

#[test]
fn hostile_tables_are_rejected() {
    let (_d, p) = tmp();
    write(&p, Compression::Zstd(3));
    let clean = std::fs::read(&p).unwrap();
    // The untouched tables round-trip through `tamper` and still open.
    assert_eq!(tamper(&p, |_, _| {}), "ok");
    CawsfArchive::open(&p).unwrap().verify().unwrap();

    fn set_u32(idx: &mut [u8], entry: usize, field: usize, v: u32) {
        let at = entry * INDEX_ENTRY + field;
        idx[at..at + 4].copy_from_slice(&v.to_le_bytes());
    }
    type Case = (
        Box<dyn Fn(&mut serde_json::Value, &mut Vec<u8>)>,
        &'static str,
    );
    let cases: Vec<Case> = vec![
        (
            Box::new(|_, idx| {
                set_u32(idx, 1, 12, u32::MAX);
                idx[32 + 24] = COMP_ZSTD;
            }),
            "exceeds the bound",
        ),
        (
            Box::new(|_, idx| idx[0..8].copy_from_slice(&(1u64 << 62).to_le_bytes())),
            "block 0: record at",
        ),
        (
            Box::new(|_, idx| {
                set_u32(idx, 0, 8, 1 << 30);
                idx[24] = COMP_ZSTD;
            }),
            "lies outside SHARD_BANK",
        ),
        (
            Box::new(|_, idx| set_u32(idx, 0, 28, 2)),
            "index entry names tensor 2",
        ),
        (Box::new(|_, idx| idx[24] = 9), "invalid compression code 9"),
        (Box::new(|_, idx| idx[26] = 1), "reserved"),
        (
            Box::new(|_, idx| idx.truncate(idx.len() - 32)),
            "outside BLOCK_INDEX",
        ),
        (
            Box::new(|_, idx| idx.truncate(idx.len() - 1)),
            "not a multiple of 32",
        ),
        (
            Box::new(|m, _| m["tensors"][0]["rows"] = 11.into()),
            "table says 11x4",
        ),
        (
            Box::new(|m, _| m["tensors"][0]["rows_per_block"] = 0.into()),
            "rows_per_block is 0",
        ),
        (
            Box::new(|m, _| m["tensors"][0]["n_blocks"] = 3.into()),
            "3 blocks but 10 rows",
        ),
        (
            Box::new(|m, _| m["tensors"][1]["first_block"] = 3.into()),
            "first_block is 3",
        ),
        (
            Box::new(|m, _| m["tensors"][2]["global"]["csize"] = (1u64 << 40).into()),
            "outside CODEBOOKS",
        ),
        (
            Box::new(|m, _| m["tensors"][2]["global"]["usize"] = (1u64 << 40).into()),
            "global blob usize 1099511627776 exceeds",
        ),
        (
            Box::new(|m, _| m["tensors"][0]["name"] = "x".into()),
            "disagrees with model tensor 0",
        ),
        (Box::new(|m, _| m["version"] = 2.into()), "META version 2"),
        (
            Box::new(|m, _| {
                m["model"]["tensors"][0]["shape"] = serde_json::json!([1u64 << 32, 1u64 << 32, 16])
            }),
            "absurd shape",
        ),
        (Box::new(|m, _| m["format"] = "zip".into()), "META format"),
        (
            Box::new(|m, _| m["tensors"] = serde_json::json!([])),
            "0 entries",
        ),
        (Box::new(|m, _| m["model"] = 5.into()), "META is not valid"),
        (
            Box::new(|m, _| m["checksum_index"].as_object_mut().unwrap().clear()),
            "checksum_index has no entry",
        ),
    ];
    for (f, want) in cases {
        std::fs::write(&p, &clean).unwrap();
        let e = tamper(&p, f);
        assert!(e.contains(want), "want {want:?}, got {e}");
    }
}

#[test]
fn writer_errors_leave_no_files() {
    let m = model();
    // A tensor added twice.
    let (dir, p) = tmp();
    let mut w = CawsfWriter::create(&p, Compression::Zstd(3)).unwrap();
    w.add_tensor(1, 1, &encoded(&m, 1)).unwrap();
    let e = w.add_tensor(1, 1, &encoded(&m, 1)).unwrap_err().to_string();
    assert!(e.contains("tensor 1 added twice"), "{e}");
    drop(w);
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    // Block count disagreeing with the shape, found at finish.
    let mut w = CawsfWriter::create(&p, Compression::Zstd(3)).unwrap();
    w.add_tensor(0, 3, &encoded(&m, 0)).unwrap();
    w.add_tensor(1, 1, &encoded(&m, 1)).unwrap();
    w.add_tensor(2, 2, &encoded(&m, 2)).unwrap(); // 1 block given, 8 rows / 2 need 4
    let e = w
        .finish(&m, serde_json::Value::Null, &[])
        .unwrap_err()
        .to_string();
    assert!(e.contains("need 4"), "{e}");
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    // Missing tensors.
    let mut w = CawsfWriter::create(&p, Compression::None).unwrap();
    w.add_tensor(0, 3, &encoded(&m, 0)).unwrap();
    assert!(w.finish(&m, serde_json::Value::Null, &[]).is_err());
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

#[test]
fn tensors_written_in_any_order_read_back() {
    let m = model();
    let (_d, p) = tmp();
    let mut w = CawsfWriter::create(&p, Compression::Zstd(3)).unwrap();
    for i in [2, 0, 1] {
        w.add_tensor(i, RPB[i], &encoded(&m, i)).unwrap();
    }
    w.finish(&m, serde_json::Value::Null, &[]).unwrap();
    let a = CawsfArchive::open(&p).unwrap();
    a.verify().unwrap();
    // SHARD_BANK holds tensor 2 first; the index is still in tensor order.
    assert!(a.block_location(2, 0).0 < a.block_location(0, 0).0);
    for i in 0..3 {
        let e = encoded(&m, i);
        for (b, blk) in e.blocks.iter().enumerate() {
            assert_eq!(&a.block_payload(i, b).unwrap(), blk, "t{i} b{b}");
        }
    }
    // Two tensors' records overlapping is corrupt whatever their order: tensor 0's
    // first entry (of 4) pointed at tensor 2's record (entry 5), which lies first.
    drop(a);
    let e = tamper(&p, |_, idx| {
        let off2 = u64::from_le_bytes(idx[5 * INDEX_ENTRY..][..8].try_into().unwrap());
        idx[..8].copy_from_slice(&off2.to_le_bytes());
    });
    assert!(e.contains("overlap"), "{e}");
}

#[test]
fn empty_routing_and_extra() {
    let m = model();
    let (_d, p) = tmp();
    let mut w = CawsfWriter::create(&p, Compression::Lz4).unwrap();
    for i in 0..3 {
        w.add_tensor(i, RPB[i], &encoded(&m, i)).unwrap();
    }
    w.finish(&m, serde_json::Value::Null, &[]).unwrap();
    let a = CawsfArchive::open(&p).unwrap();
    assert!(a.routing().is_empty());
    assert!(a.routes().unwrap().is_empty());
    a.verify().unwrap();
}

#[test]
fn routing_parser_bounds() {
    let r = routing();
    let b = encode_routing(&r);
    assert_eq!(b.len(), 32 + 40 * 3 + 8 * 3);
    assert_eq!(parse_routing(&b).unwrap(), r);
    for l in 1..b.len() {
        assert!(parse_routing(&b[..l]).is_err(), "len {l}");
    }
    let mut long = b.clone();
    long.push(0);
    assert!(parse_routing(&long).is_err());
    // Absurd counts are rejected without allocating.
    let mut huge = b[..32].to_vec();
    huge[12..16].copy_from_slice(&(1u32 << 24).to_le_bytes());
    huge[16..24].copy_from_slice(&(1u64 << 32).to_le_bytes());
    assert!(parse_routing(&huge)
        .unwrap_err()
        .to_string()
        .contains("size mismatch"));
    // Every single-byte corruption of the header and records parses or errs, never panics;
    // the interesting ones name the problem.
    for i in 0..b.len() {
        let mut c = b.clone();
        c[i] ^= 0xff;
        let _ = parse_routing(&c);
    }
    let mut v1 = b.clone();
    v1[4] = 1;
    assert!(parse_routing(&v1)
        .unwrap_err()
        .to_string()
        .contains("unsupported ROUTING version 1"));
    let mut bad_idx = b.clone();
    let at = 32 + 40 * 3; // first key entry's index
    bad_idx[at..at + 4].copy_from_slice(&7u32.to_le_bytes());
    assert!(parse_routing(&bad_idx)
        .unwrap_err()
        .to_string()
        .contains("bad key entry"));
    assert_eq!(parse_routing(&[]).unwrap(), Routing::default());
}
