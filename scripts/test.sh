#!/usr/bin/env bash
# Run every test: Rust unit and integration tests (plain `cargo test`, which needs
# neither Python nor the test model), then the real-client tests: the Rust test that
# checks GGUF against Python's `gguf` package and the real model, and the Python suite
# (llama.cpp, transformers, safetensors), with a short run of every fuzz target between.
# The print-only benches are only built.
set -euo pipefail
cd "$(dirname "$0")/.."
"scripts/setup.sh"
cargo build --release --locked 2>&1 | tail -n 3
cargo test --release --locked
# The cache's concurrency tests under shuttle's schedulers (docs/RELIABILITY.md).
cargo test --release --locked --features shuttle --lib cache::
# Every fuzz target briefly from generated seeds (docs/RELIABILITY.md, "Fuzzing").
scripts/fuzz.sh --ci
cargo bench --locked --no-run
cargo test --release --locked --test gguf_import
python3 -m pytest -q tests/clients/
