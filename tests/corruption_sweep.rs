//! Every byte of a small archive flipped in turn, in every kind (`.cawsf`, delta,
//! npy-dir plain and zstd-framed): each flip is refused at open, caught by `verify`
//! (checksums, then every block decoded), or changes nothing a mount would serve; and
//! whatever `verify` says, no block read returns values other than the original's.

mod common;

use std::path::{Path, PathBuf};

use cawsfs::archive::{decode_failures, Store};
use cawsfs::convert::{delta, npydir, ConvertOptions};
use cawsfs::import::open_source;
use cawsfs::model::ModelDesc;
use rayon::prelude::*;

/// What a mount serves is a function of these: the model description, the ROUTING
/// bytes and every tensor's values (compared bit for bit).
struct Served {
    model: ModelDesc,
    routing: Vec<u8>,
    /// Per tensor, per row block: the values.
    blocks: Vec<Vec<Vec<u32>>>,
}

fn block_rows(s: &dyn Store, t: usize) -> Vec<(u64, u64)> {
    let rows = s.model().tensors[t].rows();
    let rpb = s.tensor_summary(t).rows_per_block.max(1);
    (0..rows.div_ceil(rpb))
        .map(|b| (b * rpb, ((b + 1) * rpb).min(rows)))
        .collect()
}

fn read_block(s: &dyn Store, t: usize, (r0, r1): (u64, u64)) -> Option<Vec<u32>> {
    let cols = s.model().tensors[t].cols();
    let mut out = vec![0f32; ((r1 - r0) * cols) as usize];
    s.read_rows(t, r0, r1, &mut out).ok()?;
    Some(out.iter().map(|v| v.to_bits()).collect())
}

fn served(s: &dyn Store) -> Served {
    let blocks = (0..s.model().tensors.len())
        .map(|t| {
            block_rows(s, t)
                .into_iter()
                .map(|r| read_block(s, t, r).expect("the clean archive reads"))
                .collect()
        })
        .collect();
    Served {
        model: s.model().clone(),
        routing: s.routing_bytes().to_vec(),
        blocks,
    }
}

#[derive(Default, Debug)]
struct Tally {
    refused: usize,
    verify: usize,
    harmless: usize,
}

/// What one flipped archive does: Err(why) if it serves something wrong.
fn judge(path: &Path, reference: &Served, tally: &mut Tally) -> Result<(), String> {
    let Ok(s) = cawsfs::archive::open(path) else {
        tally.refused += 1;
        return Ok(());
    };
    let s = s.as_ref();
    // Whatever verify says, a block either fails or reads exactly the original values.
    let mut any_failed = false;
    for t in 0..s.model().tensors.len() {
        for (b, r) in block_rows(s, t).into_iter().enumerate() {
            match read_block(s, t, r) {
                None => any_failed = true,
                Some(v) if reference.blocks.get(t).and_then(|x| x.get(b)) == Some(&v) => {}
                Some(_) => return Err(format!("tensor {t} block {b} read other values")),
            }
        }
    }
    let verify_fails = !s.verify_all().is_empty() || !decode_failures(s).is_empty();
    if verify_fails {
        tally.verify += 1;
        return Ok(());
    }
    if any_failed {
        return Err("a read failed on an archive verify passed".into());
    }
    if s.model() != &reference.model {
        return Err("the model description changed unnoticed".into());
    }
    if s.routing_bytes() != reference.routing {
        return Err("ROUTING changed unnoticed".into());
    }
    tally.harmless += 1;
    Ok(())
}

/// Every file of an archive (the file itself, or a directory's files).
fn files_of(path: &Path) -> Vec<PathBuf> {
    if path.is_file() {
        return vec![path.to_path_buf()];
    }
    let mut out = Vec::new();
    for sub in ["", "tensors"] {
        for e in std::fs::read_dir(path.join(sub)).unwrap() {
            let p = e.unwrap().path();
            if p.is_file() {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// Flip every byte of every file of `archive` (one at a time, in a private copy per
/// worker) and judge each.
fn sweep(archive: &Path, scratch: &Path) -> Tally {
    let clean = cawsfs::archive::open(archive).unwrap();
    assert!(clean.verify_all().is_empty());
    let reference = served(clean.as_ref());
    drop(clean);
    let files = files_of(archive);
    let jobs: Vec<(usize, usize)> = files
        .iter()
        .enumerate()
        .flat_map(|(f, p)| (0..std::fs::metadata(p).unwrap().len() as usize).map(move |i| (f, i)))
        .collect();
    let workers = rayon::current_num_threads().max(1);
    let chunk = jobs.len().div_ceil(workers);
    let tallies: Vec<Result<Tally, String>> = jobs
        .par_chunks(chunk)
        .enumerate()
        .map(|(w, jobs)| {
            // A private copy of the archive to flip bytes in.
            let mine = scratch.join(format!("w{w}"));
            copy(archive, &mine);
            let my_files = files_of(&mine);
            let mut tally = Tally::default();
            for &(f, i) in jobs {
                let p = &my_files[f];
                let orig = std::fs::read(p).unwrap();
                let mut b = orig.clone();
                // Alternate a low and a high bit so both kinds of damage are tried.
                b[i] ^= if i % 2 == 0 { 0x01 } else { 0x80 };
                std::fs::write(p, &b).unwrap();
                let verdict = judge(&mine, &reference, &mut tally);
                std::fs::write(p, &orig).unwrap();
                verdict.map_err(|e| format!("{} byte {i}: {e}", files[f].display()))?;
            }
            Ok(tally)
        })
        .collect();
    let mut all = Tally::default();
    for t in tallies {
        let t = t.unwrap_or_else(|e| panic!("{e}"));
        all.refused += t.refused;
        all.verify += t.verify;
        all.harmless += t.harmless;
    }
    all
}

fn copy(from: &Path, to: &Path) {
    if from.is_file() {
        std::fs::copy(from, to).unwrap();
        return;
    }
    for sub in ["", "tensors"] {
        std::fs::create_dir_all(to.join(sub)).unwrap();
        for e in std::fs::read_dir(from.join(sub)).unwrap() {
            let e = e.unwrap();
            if e.file_type().unwrap().is_file() {
                std::fs::copy(e.path(), to.join(sub).join(e.file_name())).unwrap();
            }
        }
    }
}

fn tiny_source(dir: &Path) -> PathBuf {
    let src = dir.join("hf");
    std::fs::create_dir_all(&src).unwrap();
    common::write_tiny_hf(
        &src,
        common::Dims {
            hidden: 32,
            ffn: 48,
            vocab: 40,
            layers: 1,
        },
    );
    src
}

fn report(kind: &str, archive: &Path, t: &Tally) {
    let bytes: u64 = files_of(archive)
        .iter()
        .map(|p| std::fs::metadata(p).unwrap().len())
        .sum();
    println!(
        "{kind}: {bytes} bytes flipped one at a time: {} refused at open, {} caught by verify, {} harmless, 0 wrong reads",
        t.refused, t.verify, t.harmless
    );
    assert_eq!(t.refused + t.verify + t.harmless, bytes as usize);
    // Harmless bytes are the 4 KiB page padding of containers, reserved zeros and the
    // like; in these small archives they are most of a container, but not all of it.
    assert!((t.refused + t.verify) * 5 > bytes as usize, "{kind}: {t:?}");
}

#[test]
fn every_byte_flip_of_a_cawsf_archive() {
    let tmp = tempfile::tempdir().unwrap();
    let src = open_source(&tiny_source(tmp.path())).unwrap();
    let out = tmp.path().join("a.cawsf");
    let mut o = ConvertOptions::default();
    o.ndsq.rank = 2;
    o.ndsq.pq_k = 4;
    cawsfs::convert::convert(src.as_ref(), &out, &o, &|_, _, _| {}).unwrap();
    let t = sweep(&out, tmp.path());
    report("cawsf", &out, &t);
}

#[test]
fn every_byte_flip_of_a_delta_archive() {
    let tmp = tempfile::tempdir().unwrap();
    let src = open_source(&tiny_source(tmp.path())).unwrap();
    let out = tmp.path().join("a.delta");
    let o = delta::DeltaOptions {
        rank: cawsfs::codec::delta::RankChoice::Fixed(2),
        ..delta::DeltaOptions::default()
    };
    delta::convert(src.as_ref(), &out, &o, &|_, _, _| {}).unwrap();
    let t = sweep(&out, tmp.path());
    report("delta", &out, &t);
}

#[test]
fn every_byte_flip_of_npy_dirs() {
    for zstd in [false, true] {
        let tmp = tempfile::tempdir().unwrap();
        let src = open_source(&tiny_source(tmp.path())).unwrap();
        let out = tmp.path().join("npy");
        let o = npydir::NpyOptions {
            zstd,
            ..npydir::NpyOptions::default()
        };
        npydir::convert(src.as_ref(), &out, &o, &|_, _, _| {}).unwrap();
        let t = sweep(&out, tmp.path());
        report(if zstd { "npy-dir zstd" } else { "npy-dir" }, &out, &t);
    }
}
