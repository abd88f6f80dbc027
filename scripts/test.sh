#!/usr/bin/env bash
# Run every test: Rust unit and integration tests, then the real-client tests
# (llama.cpp, transformers, safetensors) against the real test model.
set -euo pipefail
cd "$(dirname "$0")/.."
"scripts/setup.sh"
cargo build --release --locked 2>&1 | tail -n 3
cargo test --release --locked
python3 -m pytest -q tests/
