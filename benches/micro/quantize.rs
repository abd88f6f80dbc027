//! ns per weight of each ggml quantizer (`gguf::quantize`) on gaussian rows, next to
//! the f32 → f16 conversion a F16 view does, single-threaded. Process CPU time, so a
//! busy machine inflates the figures less than wall time would.
//!
//! With QUANT_ARCHIVE=path (an archive, e.g. the test model converted with defaults),
//! also on its real weights: the time to decode every 2-D tensor to f32, and then to
//! serve it as F16 (decode + conversion) or as each quantized type (decode + quantize).

use std::time::Instant;

use cawsfs::gguf::quantize::quantize;
use cawsfs::gguf::GgmlType;
use half::slice::HalfFloatSliceExt;
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

const N: usize = 1 << 20;

/// This process's CPU time, in seconds (all threads: decoding may use several).
fn cpu_time() -> f64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `t` is a valid timespec to write to.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut t) };
    t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
}

/// Best of a few runs of `f` over N weights (at least half a second of runs), in ns
/// per weight.
fn ns_per_weight(mut f: impl FnMut()) -> f64 {
    f();
    let mut best = f64::MAX;
    let start = Instant::now();
    while start.elapsed().as_secs_f64() < 0.5 {
        let t = cpu_time();
        f();
        best = best.min(cpu_time() - t);
    }
    best * 1e9 / N as f64
}

const TYPES: [GgmlType; 12] = [
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
];

pub fn bench() {
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let x: Vec<f32> = (0..N)
        .map(|_| {
            let (u, v): (f32, f32) = (rng.random(), rng.random());
            (-2.0 * (1.0 - u).ln()).sqrt() * (std::f32::consts::TAU * v).cos() * 0.02
        })
        .collect();
    let mut h = vec![half::f16::ZERO; N];
    let f16 = ns_per_weight(|| h.convert_from_f32_slice(&x));
    println!("f32 -> f16 (half, the F16 view's conversion): {f16:.3} ns/weight");
    for ty in TYPES {
        let (be, bb) = ty.block();
        let mut out = vec![0u8; N / be as usize * bb as usize];
        let ns = ns_per_weight(|| quantize(ty, &x, &mut out).unwrap());
        println!(
            "{ty:?}: {ns:.3} ns/weight ({:.1}x the f16 conversion)",
            ns / f16
        );
    }
    if let Ok(path) = std::env::var("QUANT_ARCHIVE") {
        real_weights(std::path::Path::new(&path));
    }
}

/// Decode, then F16 or quantized, over every 2-D tensor of the archive at `path`.
fn real_weights(path: &std::path::Path) {
    let store = cawsfs::archive::open(path).expect("QUANT_ARCHIVE opens");
    let model = store.model();
    let mut decode = 0.0;
    let mut n = 0usize;
    let mut f16 = 0.0;
    let mut quant = vec![0.0; TYPES.len()];
    let mut h = Vec::new();
    for (t, desc) in model.tensors.iter().enumerate() {
        if desc.shape.len() != 2 {
            continue;
        }
        let (rows, cols) = (desc.shape[0], desc.cols());
        let mut w = vec![0f32; (rows * cols) as usize];
        let c = cpu_time();
        store.read_rows(t, 0, rows, &mut w).expect("rows decode");
        decode += cpu_time() - c;
        n += w.len();
        h.resize(w.len(), half::f16::ZERO);
        let c = cpu_time();
        h.convert_from_f32_slice(&w);
        f16 += cpu_time() - c;
        // Quantize the whole tensor as one run of blocks (a K-quant view needs
        // 256-column rows; timing only needs the values).
        let whole = w.len() / 256 * 256;
        for (ty, q) in TYPES.iter().zip(quant.iter_mut()) {
            let (be, bb) = ty.block();
            let mut out = vec![0u8; whole / be as usize * bb as usize];
            let c = cpu_time();
            quantize(*ty, &w[..whole], &mut out).unwrap();
            *q += (cpu_time() - c) * w.len() as f64 / whole as f64;
        }
    }
    let per = |s: f64| s * 1e9 / n as f64;
    println!(
        "{}: {n} weights of 2-D tensors; decode {:.2} ns/weight, f32 -> f16 {:.3}",
        path.display(),
        per(decode),
        per(f16)
    );
    let served_f16 = decode + f16;
    for (ty, q) in TYPES.iter().zip(&quant) {
        println!(
            "  {ty:?}: quantize {:.3} ns/weight; decode + quantize = {:.2}x decode + f16",
            per(*q),
            (decode + q) / served_f16
        );
    }
}
