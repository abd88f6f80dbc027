//! Print-only measurements (no assertions on speed): `cargo bench --bench micro` runs
//! them all, `cargo bench --bench micro -- ndsq cache` those named. They used to be
//! `#[ignore]`d unit tests; as a bench target they stay out of `cargo test` and still
//! build in CI (`cargo bench --no-run`).

mod cache;
mod layout;
mod ndsq;
mod pq;
mod quantize;

const BENCHES: &[(&str, fn())] = &[
    ("ndsq", ndsq::bench),
    ("pq", pq::train_timing),
    ("cache", cache::warm_read_throughput),
    ("layout", layout::export_throughput),
    ("quantize", quantize::bench),
];

fn main() {
    // cargo passes `--bench` (and libtest-style flags); only bare words select.
    let wanted: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    for name in &wanted {
        if !BENCHES.iter().any(|(n, _)| n == name) {
            let names: Vec<&str> = BENCHES.iter().map(|b| b.0).collect();
            eprintln!("unknown bench {name:?}; known: {}", names.join(", "));
            std::process::exit(2);
        }
    }
    for (name, run) in BENCHES {
        if wanted.is_empty() || wanted.iter().any(|w| w == name) {
            println!("== {name}");
            run();
        }
    }
}
