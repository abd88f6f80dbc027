//! Time each target's body over its seeds in a plain loop (no AFL, no fork server):
//! `bench CORPUS_DIR [ITERATIONS] [TARGET...]` prints, per seed, the mean time of one
//! execution. For finding where a target spends its time (`perf record` on this), not
//! for the exec/s figures, which come from afl-fuzz itself.
use std::path::PathBuf;
use std::time::Instant;

fn main() {
    let mut args = std::env::args().skip(1);
    let dir = PathBuf::from(
        args.next()
            .expect("usage: bench CORPUS_DIR [N] [TARGET...]"),
    );
    let rest: Vec<String> = args.collect();
    let (n, names): (usize, Vec<String>) = match rest.first().and_then(|s| s.parse().ok()) {
        Some(n) => (n, rest[1..].to_vec()),
        None => (100, rest),
    };
    let names = if names.is_empty() {
        cawsfs_fuzz::TARGETS.iter().map(|s| s.to_string()).collect()
    } else {
        names
    };
    for t in &names {
        let f = cawsfs_fuzz::targets::by_name(t).unwrap_or_else(|| panic!("no target {t}"));
        let mut total = 0.0;
        let mut count = 0;
        for seed in cawsfs_fuzz::seed_files(&dir, t) {
            let data = std::fs::read(&seed).expect("seed");
            f(&data); // warm-up (one-time initialisation)
            let t0 = Instant::now();
            for _ in 0..n {
                f(&data);
            }
            let us = t0.elapsed().as_secs_f64() * 1e6 / n as f64;
            total += us;
            count += 1;
            println!(
                "{t:<12} {:<24} {:>8} B {us:>10.1} us",
                seed.file_name().unwrap().to_string_lossy(),
                data.len()
            );
        }
        if count > 0 {
            println!(
                "{t:<12} {:<24} {:>10} {:>10.1} us mean",
                "",
                "",
                total / count as f64
            );
        }
    }
}
