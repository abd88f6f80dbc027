//! ns per weight of each ggml quantizer (`gguf::quantize`) on gaussian rows, next to
//! the f32 → f16 conversion a F16 view does, single-threaded. Thread CPU time, so a
//! busy machine inflates the figures less than wall time would.

use std::time::Instant;

use cawsfs::gguf::quantize::quantize;
use cawsfs::gguf::GgmlType;
use half::slice::HalfFloatSliceExt;
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

const N: usize = 1 << 20;

/// This thread's CPU time, in seconds.
fn cpu_time() -> f64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `t` is a valid timespec to write to.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
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
    for ty in [
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
    ] {
        let (be, bb) = ty.block();
        let mut out = vec![0u8; N / be as usize * bb as usize];
        let ns = ns_per_weight(|| quantize(ty, &x, &mut out).unwrap());
        println!(
            "{ty:?}: {ns:.3} ns/weight ({:.1}x the f16 conversion)",
            ns / f16
        );
    }
}
